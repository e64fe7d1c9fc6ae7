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
from quantkit.formats.schemes import scheme_for
from quantkit.quantize.llmcompressor_backend import quantize_with_llmcompressor
from quantkit.quantize.modelopt_backend import quantize_with_modelopt
from quantkit.quantize.recipe import CalibrationSettings, Recipe, load_recipe


def quantizable_linears(model: torch.nn.Module, recipe: Recipe) -> dict[str, torch.nn.Linear]:
    """The Linear modules the recipe quantizes, by qualified name (ignore list applied)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not recipe.ignores(n)}


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
            model, tokenizer=tokenizer, alpha=sq.alpha, num_sequences=sq.num_sequences, seq_len=sq.seq_len
        )
    scheme = scheme_for(recipe.scheme)  # None: bf16, nothing quantized
    linears = quantizable_linears(model, recipe) if scheme is not None else {}
    input_amax = {}
    if recipe.activation_scale == "static":  # compressed-tensors convention: one calibrated scale per tensor
        cal = recipe.calibration or CalibrationSettings()
        tokens = calibration_windows(tokenizer, cal.num_sequences, min(cal.seq_len, model.config.max_position_embeddings))
        maxima = channel_max(model, tokens, list(linears), desc="static activation calibration")
        input_amax = {name: m.max().reshape(1) for name, m in maxima.items()}
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for name, module in tqdm(linears.items(), desc=f"quantize {recipe.name}", unit="linear"):
        state.pop(f"{name}.weight")
        tensors = scheme.encode(module.weight.detach(), name)
        if name in input_amax:
            tensors.update(scheme.static_activation_tensors(input_amax[name]))
        for suffix, tensor in tensors.items():
            state[f"{name}.{suffix}"] = tensor.contiguous()
    ignored = sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in linears)
    if scheme is None:
        state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}

    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "bfloat16" if scheme is None else "float32"
    if scheme is not None:
        config["quantization_config"] = quantization_config(recipe, sorted(linears), ignored)
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "quantkit_recipe": recipe.name})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        tokenizer.save_pretrained(tmp)
        if smoothquant_report is not None:
            (tmp / "smoothquant.json").write_text(json.dumps(smoothquant_report.to_dict(), indent=2))
    return out_dir
