"""`quantkit quantize MODEL RECIPE OUT`: write a quantized checkpoint (format: docs/checkpoint-format.md).

Two phases kept apart (gpt-fast): this module computes the quantized state dict and writes it;
`quantkit.quantize.fake_quant` (transformers) and the vLLM plugin know how to run it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantkit.models  # noqa: F401  (registers model_type "quantkit")
from quantkit.atomic import atomic_dir
from quantkit.calibrate import channel_max, smooth_model
from quantkit.checkpoints import check_checkpoint_dir
from quantkit.data import calibration_windows
from quantkit.formats.experts import expert_matrices, fused_experts_modules
from quantkit.formats.schemes import scheme_for
from quantkit.quantize.llmcompressor_backend import quantize_with_llmcompressor
from quantkit.quantize.modelopt_backend import quantize_with_modelopt
from quantkit.quantize.recipe import CalibrationSettings, Recipe, load_recipe


def quantizable_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weight (N, K) of every matrix a recipe may quantize, by checkpoint module name: each nn.Linear, and each
    expert matrix `<experts>.<e>.<proj>` of fused routed experts (`quantkit.formats.experts`; views)."""
    weights = {n: m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, module in fused_experts_modules(model).items():
        weights.update(expert_matrices(name, module))
    return weights


def checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint names: fused routed experts split into per-expert
    `<experts>.<e>.<proj>.weight` (what transformers' save_pretrained writes and vLLM's FusedMoE loads)."""
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for name, module in fused_experts_modules(model).items():
        del state[f"{name}.gate_up_proj"], state[f"{name}.down_proj"]
        state.update({f"{m}.weight": w.detach().clone().contiguous() for m, w in expert_matrices(name, module).items()})
    return state


def quantization_config(recipe: Recipe, quantized: list[str], ignored: list[str]) -> dict:
    """The `quantization_config` entry of config.json (the scheme's keys: `quantkit.formats.schemes`)."""
    return {
        "quant_method": "quantkit",
        "recipe": recipe.name,
        **scheme_for(recipe.scheme).quantization_config(recipe.activation_scale),
        "quantized_modules": quantized,
        "ignored_modules": ignored,
        "smoothquant": None if recipe.smoothquant is None else vars(recipe.smoothquant),
    }


def quantize_checkpoint(model_dir: str | Path, recipe: Recipe | str, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Quantize the checkpoint in `model_dir` with `recipe`; write it atomically to `out_dir`."""
    recipe = load_recipe(recipe) if isinstance(recipe, (str, Path)) else recipe
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_checkpoint_dir(model_dir)  # CheckpointError names a missing config, unreadable or truncated shards
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True (--overwrite) to replace it")
    if recipe.backend == "llmcompressor":
        return quantize_with_llmcompressor(model_dir, recipe, out_dir)
    if recipe.backend == "modelopt":
        return quantize_with_modelopt(model_dir, recipe, out_dir)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    smoothquant_report = None
    if recipe.smoothquant is not None:  # folds into the float32 weights; verified function-preserving
        sq = recipe.smoothquant
        smoothquant_report = smooth_model(
            model, tokenizer=tokenizer, alpha=sq.alpha, num_sequences=sq.num_sequences, seq_len=sq.seq_len,
            experts=sq.experts,
        )
    scheme = scheme_for(recipe.scheme)  # None: bf16, nothing quantized
    weights = quantizable_weights(model)
    quantized = {n: w for n, w in weights.items() if not recipe.ignores(n)} if scheme is not None else {}
    input_amax = {}
    if recipe.activation_scale == "static":  # compressed-tensors convention: one calibrated scale per tensor
        cal = recipe.calibration or CalibrationSettings()
        tokens = calibration_windows(tokenizer, cal.num_sequences, min(cal.seq_len, model.config.max_position_embeddings))
        # expert matrices: every token through every expert (calibrate-all-experts mode, quantkit.calibrate.stats)
        maxima = channel_max(model, tokens, list(quantized), desc="static activation calibration")
        input_amax = {name: m.max().reshape(1) for name, m in maxima.items()}
    state = checkpoint_state(model)
    for name, weight in tqdm(quantized.items(), desc=f"quantize {recipe.name}", unit="matrix"):
        state.pop(f"{name}.weight")
        tensors = scheme.encode(weight.detach().contiguous(), name)
        if name in input_amax:
            tensors.update(scheme.static_activation_tensors(input_amax[name]))
        for suffix, tensor in tensors.items():
            state[f"{name}.{suffix}"] = tensor.contiguous()
    ignored = sorted(n for n in weights if n not in quantized)
    if scheme is None:
        state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}

    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "bfloat16" if scheme is None else "float32"
    if scheme is not None:
        config["quantization_config"] = quantization_config(recipe, sorted(quantized), ignored)
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "quantkit_recipe": recipe.name})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        tokenizer.save_pretrained(tmp)
        if smoothquant_report is not None:
            (tmp / "smoothquant.json").write_text(json.dumps(smoothquant_report.to_dict(), indent=2))
    return out_dir
