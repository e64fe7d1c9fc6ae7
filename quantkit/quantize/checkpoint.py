"""`quantkit quantize MODEL RECIPE OUT`: write a quantized checkpoint (format: docs/checkpoint-format.md).

Two phases kept apart (gpt-fast): this module computes the quantized state dict and writes it;
`quantkit.quantize.fake_quant` (transformers) and the vLLM plugin know how to run it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

import quantkit.models  # noqa: F401  (registers model_type "quantkit")
from quantkit.models.attention import load_reference_model
from quantkit.atomic import atomic_dir
from quantkit.calibrate import SmoothQuantReport, channel_max, smooth_model
from quantkit.calibrate.layers import skeleton_model
from quantkit.calibrate.mappings import resolve_mappings
from quantkit.checkpoints import SAFETENSORS_DTYPES, CheckpointError, TensorHeaders, check_checkpoint_dir
from quantkit.data import calibration_windows
from quantkit.formats.experts import expert_matrices, fused_experts_modules
from quantkit.formats.schemes import UNQUANTIZED, Scheme, scheme_for
from quantkit.quantize.llmcompressor_backend import quantize_with_llmcompressor
from quantkit.quantize.modelopt_backend import quantize_with_modelopt
from quantkit.quantize.recipe import CalibrationSettings, Recipe, load_recipe

logger = logging.getLogger(__name__)
# SmoothQuant's factors beside the weights (torch.save; not *.safetensors, which vLLM and transformers would load as weights)
SMOOTHQUANT_FACTORS = "smoothquant_factors.pt"


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


def unquantized_to_source_dtype(state: dict[str, torch.Tensor], quantized: list[str], source: TensorHeaders,
                                config: PretrainedConfig, keep_float32: set[str]) -> dict[str, torch.Tensor]:
    """The tensors a recipe leaves unquantized as the source checkpoint holds them, in place: each floating tensor
    back to its source dtype (a key the source lacks, e.g. split experts: the source's most common floating dtype),
    except `keep_float32` (SmoothQuant's folded norm weights: their factors are not representable in bf16); a tied
    `lm_head.weight` the source does not store is dropped (tied embeddings stay tied). `quantized`: module names
    whose `.weight` the scheme replaces."""
    replaced = {f"{name}.weight" for name in quantized}
    floating = [SAFETENSORS_DTYPES[d] for d, _ in source.values() if SAFETENSORS_DTYPES.get(d, torch.uint8).is_floating_point]
    common = max(set(floating), key=floating.count) if floating else torch.float32
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in source.keys() | replaced:
        state.pop("lm_head.weight", None)
    for key, tensor in state.items():
        if key in replaced or key in keep_float32 or not tensor.is_floating_point():
            continue
        dtype = SAFETENSORS_DTYPES.get(source[key][0], common) if key in source else common
        state[key] = tensor.to(dtype)
    return state


def smoothed_norm_keys(plan_smooth_modules: list[str], state: dict[str, torch.Tensor]) -> set[str]:
    """State keys of the modules SmoothQuant folds its factors into, every parameter under them (a norm's weight
    and bias, GatedNorm's gate_down columns): kept float32."""
    prefixes = tuple(f"{m}." for m in plan_smooth_modules)
    return {key for key in state if key.startswith(prefixes)} if prefixes else set()


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


def encode_matrices(state: dict[str, torch.Tensor], quantized: dict[str, torch.Tensor], scheme: Scheme,
                    input_amax: dict[str, torch.Tensor], desc: str, progress: bool = True) -> None:
    """Replace each quantized matrix's `<name>.weight` in `state` by the scheme's tensors (plus its static
    activation tensors where `input_amax` has the calibrated max |x|, shape (1,)), in place."""
    for name, weight in tqdm(quantized.items(), desc=desc, unit="matrix", disable=not (progress and quantized)):
        state.pop(f"{name}.weight")
        tensors = scheme.encode(weight.detach().contiguous(), name)
        if name in input_amax:
            tensors.update(scheme.static_activation_tensors(input_amax[name]))
        for suffix, tensor in tensors.items():
            state[f"{name}.{suffix}"] = tensor.contiguous()


def output_config(config: PretrainedConfig, architecture: str, recipe: Recipe, quantized: list[str], ignored: list[str]) -> dict:
    """config.json of the quantized checkpoint: the source's, with its class, dtype and quantization_config."""
    out = config.to_dict()
    out["architectures"] = [architecture]
    out["dtype"] = "bfloat16" if recipe.scheme == UNQUANTIZED else "float32"
    if recipe.scheme != UNQUANTIZED:
        out["quantization_config"] = quantization_config(recipe, sorted(quantized), sorted(ignored))
    return out


def write_side_files(out_dir: Path, config: dict, tokenizer, smoothquant_report: SmoothQuantReport | None) -> None:
    """config.json, the tokenizer, and for SQ recipes smoothquant.json and SMOOTHQUANT_FACTORS of a quantized
    checkpoint."""
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer.save_pretrained(out_dir)
    if smoothquant_report is not None:
        (out_dir / "smoothquant.json").write_text(json.dumps(smoothquant_report.to_dict(), indent=2))
        torch.save({name: s.float().cpu() for name, s in smoothquant_report.scales.items()}, out_dir / SMOOTHQUANT_FACTORS)


def read_smoothquant_factors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """SmoothQuant's factors s (smoothing module name -> (channels,) float32; its output was divided by s, its
    consumers' columns multiplied) as the checkpoint records them; CheckpointError if it records none."""
    path = Path(model_dir) / SMOOTHQUANT_FACTORS
    if not path.exists():
        raise CheckpointError(f"{model_dir}: a SmoothQuant checkpoint without {SMOOTHQUANT_FACTORS} (written by an "
                              "older quantkit): quantize it again")
    return torch.load(path, weights_only=True)


def float32_bytes(model_dir: str | Path) -> int:
    """Bytes of the checkpoint's tensors in float32 (what the whole-model path holds, twice: model and state)."""
    _, headers = check_checkpoint_dir(model_dir)
    return sum(4 * math.prod(shape) for _, shape in headers.values())


def available_memory_bytes() -> int:
    """MemAvailable of /proc/meminfo (bytes); physical memory where that file is absent."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def refuse_unmappable_early(model_dir: Path, recipe: Recipe) -> None:
    """SmoothQuant's mappings resolved on the model built from config.json alone (meta device; the traced rule
    gives one layer at a time random weights), so that a model SmoothQuant cannot fold is refused in seconds, not
    after loading it: SmoothQuantMappingError."""
    resolve_mappings(skeleton_model(AutoConfig.from_pretrained(model_dir)), experts=recipe.smoothquant.experts)


def quantize_checkpoint(model_dir: str | Path, recipe: Recipe | str, out_dir: str | Path, *, overwrite: bool = False,
                        streaming: bool | None = None) -> Path:
    """Quantize the checkpoint in `model_dir` with `recipe`; write it atomically to `out_dir`.

    streaming: True runs `quantkit.quantize.streaming` (one decoder layer in memory, sharded output, the same
    tensors); False loads the whole model in float32 (one model.safetensors); None (default) streams when the
    whole-model path would need more than the available memory (2 x the float32 size, `float32_bytes`)."""
    recipe = load_recipe(recipe) if isinstance(recipe, (str, Path)) else recipe
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_checkpoint_dir(model_dir)  # CheckpointError names a missing config, unreadable or truncated shards
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True (--overwrite) to replace it")
    if streaming and recipe.backend != "quantkit":
        raise ValueError(f"recipe {recipe.name}: streaming quantization runs quantkit's own backend only, not {recipe.backend!r}")
    if recipe.backend == "llmcompressor":
        return quantize_with_llmcompressor(model_dir, recipe, out_dir)
    if recipe.backend == "modelopt":
        return quantize_with_modelopt(model_dir, recipe, out_dir)
    if streaming is None:
        need, have = 2 * float32_bytes(model_dir), available_memory_bytes()
        streaming = need > have
        if streaming:
            logger.info("quantize: the whole-model path needs ~%.1f GB, %.1f GB available: streaming", need / 1e9, have / 1e9)
    if streaming:
        from quantkit.quantize.streaming import quantize_streaming

        return quantize_streaming(model_dir, recipe, out_dir, overwrite=overwrite)

    if recipe.smoothquant is not None:
        refuse_unmappable_early(model_dir, recipe)
    model = load_reference_model(model_dir, torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    smoothquant_report = None
    if recipe.smoothquant is not None:  # folds into the float32 weights; verified function-preserving
        sq = recipe.smoothquant
        smoothquant_report = smooth_model(
            model, recipe.calibration_source(model.config.model_type), tokenizer, alpha=sq.alpha,
            num_sequences=sq.num_sequences, seq_len=sq.seq_len, experts=sq.experts, early_stop=sq.early_stop_rule(),
        )
    scheme = scheme_for(recipe.scheme)  # None: bf16, nothing quantized
    weights = quantizable_weights(model)
    quantized = {n: w for n, w in weights.items() if not recipe.ignores(n)} if scheme is not None else {}
    input_amax = {}
    if recipe.activation_scale == "static":  # compressed-tensors convention: one calibrated scale per tensor
        cal = recipe.calibration or CalibrationSettings()
        tokens = calibration_windows(tokenizer, cal.num_sequences, min(cal.seq_len, model.config.max_position_embeddings),
                                     recipe.calibration_source(model.config.model_type))
        # expert matrices: every token through every expert (calibrate-all-experts mode, quantkit.calibrate.stats)
        maxima = channel_max(model, tokens, list(quantized), desc="static activation calibration")
        input_amax = {name: m.max().reshape(1) for name, m in maxima.items()}
    state = checkpoint_state(model)
    if scheme is not None:
        smoothed = [] if smoothquant_report is None else [m.smooth for m in smoothquant_report.mappings]
        _, source = check_checkpoint_dir(model_dir)
        unquantized_to_source_dtype(state, list(quantized), source, model.config, smoothed_norm_keys(smoothed, state))
        encode_matrices(state, quantized, scheme, input_amax, f"quantize {recipe.name}")
    else:
        state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}

    config = output_config(model.config, type(model).__name__, recipe, list(quantized), [n for n in weights if n not in quantized])
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "quantkit_recipe": recipe.name})
        write_side_files(tmp, config, tokenizer, smoothquant_report)
    return out_dir
