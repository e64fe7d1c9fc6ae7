"""What both quantize paths (whole model: `quantkit.quantize.checkpoint`; one layer at a time:
`quantkit.quantize.streaming`) write, in the format of docs/checkpoint-format.md: the parameters' state dict, the
unquantized tensors back in the source's dtype, the scheme's encoded matrices, config.json with its
`quantization_config`, and the side files (tokenizer, smoothquant.json, smoothquant_factors.pt), which
`read_smoothquant_factors` reads back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import torch
from tqdm import tqdm
from transformers import PretrainedConfig

from quantkit.calibrate import SmoothQuantReport
from quantkit.checkpoints import SAFETENSORS_DTYPES, CheckpointError, TensorHeaders, write_source_record
from quantkit.formats.constants import ActivationScale
from quantkit.formats.experts import expert_matrices, fused_experts_modules
from quantkit.formats.schemes import get_scheme
from quantkit.quantize.plan import QuantPlan

# The .safetensors header's metadata of every written checkpoint: one key, so that the header's bytes do not depend on
# the order in which safetensors serializes a dict (its hash map's, which varies between processes); the recipe's
# name is in config.json's quantization_config
SAFETENSORS_METADATA = {"format": "pt"}

# SmoothQuant's factors beside the weights (torch.save; not *.safetensors, which vLLM and transformers would load
# as weights)
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


def unquantized_to_source_dtype(
    state: dict[str, torch.Tensor],
    quantized: list[str],
    source: TensorHeaders,
    config: PretrainedConfig,
    keep_float32: set[str],
) -> dict[str, torch.Tensor]:
    """The tensors a recipe leaves unquantized as the source checkpoint holds them, in place: each floating tensor
    back to its source dtype (a key the source lacks, e.g. split experts: the source's most common floating dtype),
    except `keep_float32` (SmoothQuant's folded norm weights: their factors are not representable in bf16); a tied
    `lm_head.weight` the source does not store is dropped (tied embeddings stay tied). `quantized`: module names
    whose `.weight` the scheme replaces."""
    replaced = {f"{name}.weight" for name in quantized}
    floating = [
        SAFETENSORS_DTYPES[d] for d, _ in source.values() if SAFETENSORS_DTYPES.get(d, torch.uint8).is_floating_point
    ]
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


def encode_matrices(
    state: dict[str, torch.Tensor],
    quantized: dict[str, torch.Tensor],
    plan: QuantPlan,
    input_amax: dict[str, torch.Tensor],
    desc: str,
    progress: bool = True,
    scales: dict[str, dict[str, torch.Tensor]] | None = None,
) -> None:
    """Replace each quantized matrix's `<name>.weight` in `state` by its scheme's tensors (`plan.scheme_of`, weight
    decode scales min-max or MSE-searched as the plan says, or as `scales` gives them for that matrix (GPTQ's); plus
    its static activation tensors where `input_amax` has the calibrated max |x|, shape (1,), and the scheme has a
    static mode), in place."""
    scales = scales or {}
    for name, weight in tqdm(quantized.items(), desc=desc, unit="matrix", disable=not (progress and quantized)):
        scheme = get_scheme(cast(str, plan.scheme_of(name)))
        state.pop(f"{name}.weight")
        tensors = scheme.encode(weight.detach().contiguous(), name, plan.weight_scales, scales.get(name))
        if name in input_amax and ActivationScale.STATIC in scheme.activation_scales:
            tensors.update(scheme.static_activation_tensors(input_amax[name]))
        for suffix, tensor in tensors.items():
            state[f"{name}.{suffix}"] = tensor.contiguous()


def output_config(config: PretrainedConfig, architecture: str, plan: QuantPlan) -> dict:
    """config.json of the quantized checkpoint: the source's, with its class, dtype and quantization_config (none
    for a plan that quantizes nothing)."""
    out = config.to_dict()
    out["architectures"] = [architecture]
    out["dtype"] = "bfloat16" if plan.scheme is None else "float32"
    if plan.scheme is not None:
        out["quantization_config"] = plan.quantization_config()
    return out


def write_side_files(
    out_dir: Path, config: dict, tokenizer, smoothquant_report: SmoothQuantReport | None, source_dir: str | Path
) -> None:
    """config.json, the tokenizer, the source record (`quantkit.checkpoints.write_source_record`), and for SQ recipes
    smoothquant.json and SMOOTHQUANT_FACTORS of a quantized checkpoint."""
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    write_source_record(out_dir, source_dir)
    tokenizer.save_pretrained(out_dir)
    if smoothquant_report is not None:
        (out_dir / "smoothquant.json").write_text(json.dumps(smoothquant_report.to_dict(), indent=2))
        torch.save(
            {name: s.float().cpu() for name, s in smoothquant_report.scales.items()}, out_dir / SMOOTHQUANT_FACTORS
        )


def read_smoothquant_factors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """SmoothQuant's factors s (smoothing module name -> (channels,) float32; its output was divided by s, its
    consumers' columns multiplied) as the checkpoint records them; CheckpointError if it records none."""
    path = Path(model_dir) / SMOOTHQUANT_FACTORS
    if not path.exists():
        raise CheckpointError(
            f"{model_dir}: a SmoothQuant checkpoint without {SMOOTHQUANT_FACTORS} (written by an "
            "older quantkit): quantize it again"
        )
    return torch.load(path, weights_only=True)
