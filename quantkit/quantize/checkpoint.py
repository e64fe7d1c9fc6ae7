"""`quantkit quantize MODEL RECIPE OUT`: write a quantized checkpoint (format: docs/checkpoint-format.md).

Two phases kept apart (gpt-fast): this module computes the quantized state dict (the whole model in memory, or
one layer at a time through `quantkit.quantize.streaming`) and writes it (`quantkit.quantize.output`);
`quantkit.quantize.fake_quant` (transformers) and the vLLM plugin know how to run it.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer

import quantkit.models  # noqa: F401  (registers model_type "quantkit")
from quantkit.atomic import atomic_dir, check_output_dir
from quantkit.calibrate import channel_max, smooth_model
from quantkit.calibrate.layers import check_weights_match_config, skeleton_model
from quantkit.calibrate.mappings import resolve_mappings
from quantkit.calibrate.stats_cache import CacheLocation
from quantkit.checkpoints import check_checkpoint_dir
from quantkit.models.attention import load_reference_model
from quantkit.quantize.llmcompressor_backend import quantize_with_llmcompressor
from quantkit.quantize.modelopt_backend import quantize_with_modelopt
from quantkit.quantize.output import (
    SAFETENSORS_METADATA,
    checkpoint_state,
    encode_matrices,
    output_config,
    quantizable_weights,
    smoothed_norm_keys,
    unquantized_to_source_dtype,
    write_side_files,
)
from quantkit.quantize.plan import GPTQStep, QuantPlan, RotationStep
from quantkit.quantize.recipe import (
    Backend,
    Recipe,
    load_recipe,
)
from quantkit.quantize.rotation import (
    RotationReport,
    check_online_quantized,
    plan_rotation,
    rotate_model,
    search_through_online,
)
from quantkit.quantize.streaming import quantize_streaming

# The peers' own code, one entry a backend: (model_dir, recipe, out_dir) -> the written checkpoint dir.
PEER_BACKENDS: dict[Backend, Callable[[Path, Recipe, Path], Path]] = {
    Backend.LLMCOMPRESSOR: quantize_with_llmcompressor,
    Backend.MODELOPT: quantize_with_modelopt,
}

logger = logging.getLogger(__name__)


def float32_bytes(model_dir: str | Path) -> int:
    """Bytes of the checkpoint's tensors in float32 (what the whole-model path holds, twice: model and state)."""
    _, headers = check_checkpoint_dir(model_dir)
    return sum(4 * math.prod(shape) for _, shape in headers.values())


# The whole-model path's peak, in units of the checkpoint's float32 size F (`float32_bytes`): the float32 model, its
# float32 output state and the encoding's temporaries (2.25 F; measured 1.97 F + the floor on the coder), and for a
# recipe that calibrates (SmoothQuant, GPTQ, static scales, rotation) its calibration passes, statistics, Hessians and
# the fold check's logits (0.5 F more); plus a floor for the imports and the activations. Measured peaks against it
# (0.79-0.90x): docs/results/quantize-memory.md.
WHOLE_MODEL_FACTOR = 2.25
CALIBRATION_FACTOR = 0.5
WHOLE_MODEL_FLOOR_BYTES = 1 << 30


def whole_model_bytes(model_dir: str | Path, recipe: Recipe) -> int:
    """The whole-model path's expected peak resident memory for `recipe` on this checkpoint (bytes; see
    WHOLE_MODEL_FACTOR): an upper estimate, so that `quantize` streams when in doubt."""
    calibrates = recipe.smoothquant or recipe.gptq or recipe.rotation or recipe.static_activations
    factor = WHOLE_MODEL_FACTOR + (CALIBRATION_FACTOR if calibrates else 0.0)
    return int(factor * float32_bytes(model_dir)) + WHOLE_MODEL_FLOOR_BYTES


def available_memory_bytes() -> int:
    """MemAvailable of /proc/meminfo (bytes); physical memory where that file is absent."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def statistics_location(root: str | Path | None, model_dir: Path, plan: QuantPlan) -> CacheLocation | None:
    """Where the plan's SmoothQuant statistics of `model_dir` may be cached: None without a root, without
    SmoothQuant, or with rotation (a residual rotation's statistics are of the rotated model, not of `model_dir`'s;
    an input rotation's smoothing is searched, and a search is measured, not cached)."""
    if root is None or plan.smoothquant is None or plan.rotation is not None:
        return None
    return CacheLocation(Path(root), model_dir)


def quantize_checkpoint(
    model_dir: str | Path,
    recipe: Recipe | str,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    streaming: bool | None = None,
    statistics_cache: str | Path | None = None,
) -> Path:
    """Quantize the checkpoint in `model_dir` with `recipe`; write it atomically to `out_dir`.

    streaming: True runs `quantkit.quantize.streaming` (one decoder layer in memory, sharded output, the same
    tensors); False loads the whole model in float32 (one model.safetensors); None (default) streams when the
    whole-model path would need more than the available memory (`whole_model_bytes`). The choice and the estimate
    are printed before any work.
    statistics_cache: a directory where SmoothQuant's statistics of this source are reused from an earlier
    quantization on the same windows, or kept for a later one (`quantkit.calibrate.stats_cache`; the same bytes
    either way)."""
    recipe = load_recipe(recipe) if isinstance(recipe, (str, Path)) else recipe
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_checkpoint_dir(model_dir)  # CheckpointError names a missing config, unreadable or truncated shards
    check_output_dir(out_dir, overwrite=overwrite, inputs=(model_dir,))  # never the source: before any work
    check_weights_match_config(model_dir)  # a layer config.json declares but the weights lack, a wrong shape
    if streaming and recipe.backend != Backend.QUANTKIT:
        raise ValueError(
            f"recipe {recipe.name}: streaming quantization runs quantkit's own backend only, "
            f"not {str(recipe.backend)!r}"
        )
    return _quantize(model_dir, recipe, out_dir, overwrite=overwrite, streaming=streaming, cache_dir=statistics_cache)


def _quantize(
    model_dir: Path, recipe: Recipe, out_dir: Path, *, overwrite: bool, streaming: bool | None, cache_dir
) -> Path:
    """`quantize_checkpoint` after its checks: the peer backend's, the streaming or the whole-model path."""
    if recipe.backend in PEER_BACKENDS:
        return PEER_BACKENDS[recipe.backend](model_dir, recipe, out_dir)
    config = AutoConfig.from_pretrained(model_dir)
    skeleton = skeleton_model(config)  # meta device: names and structure, so that a refusal comes in seconds
    plan = QuantPlan.resolve(recipe, config, list(quantizable_weights(skeleton)))
    if plan.smoothquant is not None:  # SmoothQuant's mappings resolved on the skeleton: SmoothQuantMappingError
        resolve_mappings(skeleton, **plan.smoothquant.settings.mapping_flags())
    need, have = whole_model_bytes(model_dir, recipe), available_memory_bytes()
    if streaming is None:
        streaming = need > have
    path = "streaming (one decoder layer at a time)" if streaming else f"whole-model (peak ~{need / 1e9:.1f} GB)"
    print(
        f"quantize: {path}; the whole-model path would need ~{need / 1e9:.1f} GB, {have / 1e9:.1f} GB available",
        flush=True,
    )
    cache = statistics_location(cache_dir, model_dir, plan)
    if streaming:
        return quantize_streaming(model_dir, plan, out_dir, overwrite=overwrite, statistics_cache=cache)

    model = load_reference_model(model_dir, torch.float32)
    if tuple(quantizable_weights(model)) != plan.matrices:
        raise RuntimeError(f"{model_dir}: the loaded model's matrices differ from those of its config's skeleton")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rotation, smooth_first = None, plan.rotation is not None and plan.rotation.settings.after_smoothing
    if plan.rotation is not None and not smooth_first:
        rotation = _rotate(model, tokenizer, plan.rotation, plan.quantized)
    online: dict[str, int] = {}
    if smooth_first:  # an input rotation: planned and checked now (refused in seconds, as streaming refuses it),
        settings = cast(RotationStep, plan.rotation).settings  # applied after the smoothing's fold
        online = plan_rotation(model, settings.online, settings.down_block, False, plan.quantized).online_hadamard
        check_online_quantized(recipe.name, online, plan.quantized)
    smoothquant_report = None
    if plan.smoothquant is not None:  # folds into the float32 weights; verified function-preserving
        sq, search = plan.smoothquant.settings, plan.smoothquant.search
        if smooth_first and search is not None:  # measured through the input rotation that follows
            search = search_through_online(search, online)
        smoothquant_report = smooth_model(
            model,
            plan.smoothquant.windows.tokens(tokenizer),
            alpha=sq.alpha,
            include_v_o=sq.include_v_o,
            include_up_down=sq.include_up_down,
            experts=sq.experts,
            early_stop=sq.early_stop_rule(),
            search=search,
            statistics_cache=cache,
        )
    if plan.rotation is not None and smooth_first:  # an input rotation: after the smoothing's fold
        rotation = _rotate(model, tokenizer, plan.rotation, plan.quantized)
    weights = quantizable_weights(model)  # again: rotation may have replaced a tied head's tensor
    quantized = {n: weights[n] for n in plan.quantized}
    if rotation is not None:
        check_online_quantized(recipe.name, rotation.online_hadamard, quantized)
    gptq_scales = _gptq(model, tokenizer, plan) if plan.gptq is not None else {}
    input_amax = {}
    if plan.static_scales is not None:  # compressed-tensors convention: one calibrated scale per tensor
        tokens = plan.static_scales.tokens(tokenizer)
        # expert matrices: every token through every expert (calibrate-all-experts mode, quantkit.calibrate.stats)
        maxima = channel_max(model, tokens, list(quantized), desc="static activation calibration")
        input_amax = {name: m.max().reshape(1) for name, m in maxima.items()}
    state = checkpoint_state(model)
    if plan.scheme is not None:
        smoothed = [] if smoothquant_report is None else [m.smooth for m in smoothquant_report.mappings]
        _, source = check_checkpoint_dir(model_dir)
        unquantized_to_source_dtype(state, list(quantized), source, model.config, smoothed_norm_keys(smoothed, state))
        encode_matrices(state, quantized, plan, input_amax, f"quantize {recipe.name}", scales=gptq_scales)
    else:
        state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}

    config = output_config(model.config, type(model).__name__, plan)
    if rotation is not None:
        config["quantization_config"]["rotation"] = rotation.to_dict()
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata=SAFETENSORS_METADATA)
        write_side_files(tmp, config, tokenizer, smoothquant_report, model_dir)
    return out_dir


def _rotate(model, tokenizer, step: RotationStep, quantized: list[str]) -> RotationReport:
    """Rotate the float32 model in place (`quantkit.quantize.rotation`), its function checked on the step's check
    windows; `quantized`: the matrices the plan quantizes (full names)."""
    settings = step.settings
    return rotate_model(
        model,
        settings.seed,
        settings.online,
        step.check.tokens(tokenizer),
        settings.down_block,
        settings.block,
        settings.residual,
        quantized,
        settings.online_o,
    )


def _gptq(model, tokenizer, plan: QuantPlan) -> dict[str, dict[str, torch.Tensor]]:
    """GPTQ every quantized Linear and routed expert matrix of the decoder layers in place
    (`quantkit.quantize.gptq.gptq_layers`) on the plan's GPTQ windows; their decode scales by name."""
    from quantkit.quantize.gptq import gptq_layers

    step = cast(GPTQStep, plan.gptq)
    with torch.no_grad():
        return gptq_layers(
            model,
            step.windows.tokens(tokenizer),
            plan.scheme_of,
            step.settings.block_size,
            step.settings.dampening,
            search_scales=plan.mse_scales,
            act_order=step.settings.act_order,
        )
