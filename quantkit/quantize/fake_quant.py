"""Fake-quant forward in transformers: the numerical reference the vLLM serving path is held against.

`load_fake_quant_model(dir)` rebuilds the model from a quantkit checkpoint: every quantized Linear
becomes a `FakeQuantLinear` whose weight is the checkpoint's decoded weight (exact) and whose input is
quantized-dequantized per token (FP8, NVFP4) or with the static NVFP4 scale, then multiplied in float32. Fused routed
experts (`quantkit.formats.experts`) become a `FakeQuantExperts`: each expert's matrices decoded, and its
activations quantized at BOTH expert inputs (the block input before gate/up, the intermediate before down),
per token or with the expert matrix's static scale, as vLLM's FusedMoE method must (issue 16).
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import quantkit.models  # noqa: F401
from quantkit.calibrate.alpha_search import QuantizedProduct, QuantizedWeight
from quantkit.checkpoints import check_checkpoint_dir, read_state
from quantkit.formats.checkpoint_tensors import check_quantized_tensors
from quantkit.formats.experts import (
    expert_matrices,
    fuse_expert_matrices,
    fused_experts_modules,
    per_expert,
    routed_experts_forward,
)
from quantkit.formats.hadamard import block_hadamard
from quantkit.formats.schemes import (
    Scheme,
    checkpoint_suffixes,
    experts_online_block,
    get_scheme,
    module_scheme,
    online_hadamard_blocks,
    scheme_for,
    scheme_from_config,
)
from quantkit.models.attention import reference_attention
from quantkit.quantize.recipe import Recipe


class FakeQuantLinear(torch.nn.Module):
    """y = fake_quant(x) @ W_decoded^T + b, in float32, cast to the input dtype; a rotated checkpoint's online
    Hadamard block (`online_hadamard`) transforms x first (`block_hadamard`, float32)."""

    # buffers (register_buffer)
    weight: torch.Tensor
    bias: torch.Tensor | None
    input_global_scale: torch.Tensor | None

    def __init__(
        self,
        scheme: Scheme,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        input_global_scale: torch.Tensor | None,
        quantize_activations: bool = True,
        online_hadamard: int | None = None,
    ) -> None:
        super().__init__()
        self.scheme = scheme
        self.quantize_activations = quantize_activations
        self.online_hadamard = online_hadamard
        self.register_buffer("weight", weight.float())
        self.register_buffer("bias", None if bias is None else bias.float())
        self.register_buffer("input_global_scale", input_global_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., K) -> (..., N) in x's dtype: fake-quantized x (float32 x when quantize_activations is off) times the
        decoded weight, + bias, in float32."""
        h = self.quantizer_input(x)
        xq = self.scheme.fake_quant_activation(h, self.input_global_scale) if self.quantize_activations else h.float()
        return torch.nn.functional.linear(xq, self.weight, self.bias).to(x.dtype)

    def quantizer_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as the activation quantizer reads it: x (I (x) H_b) in float32 where the checkpoint's rotation puts an
        online Hadamard of block b here, else x itself."""
        return x if self.online_hadamard is None else block_hadamard(x, self.online_hadamard)


class FakeQuantExperts(torch.nn.Module):
    """Routed experts with decoded weights and fake-quantized inputs; the forward signature of transformers'
    fused expert modules: (hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H).

    Expert e: y = down_e(fq2(act(gate_e(fq1(x))) * up_e(fq1(x)))), float32, times its routing weight, summed
    over the token's k experts. fq1 / fq2: the scheme's activation quantize-dequantize (per token, or static
    with `input_global_scale[e, 0]` (gate_proj's, equal to up_proj's: one input, one scale) / `[e, 1]`
    (down_proj's)); identity where that expert matrix is not quantized (`quantized[e, 0 or 1]` False). A rotated
    checkpoint's online Hadamard block (`online_hadamard`) transforms act(gate) * up first (`block_hadamard`,
    float32), as on a dense down_proj.
    """

    # buffers (register_buffer)
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor
    quantized: torch.Tensor
    input_global_scale: torch.Tensor | None

    def __init__(
        self,
        scheme: Scheme,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        act_fn: torch.nn.Module,
        quantized: torch.Tensor,
        input_global_scale: torch.Tensor | None,
        quantize_activations: bool = True,
        online_hadamard: int | None = None,
    ) -> None:
        super().__init__()
        self.scheme, self.act_fn, self.quantize_activations = scheme, act_fn, quantize_activations
        self.online_hadamard = online_hadamard  # formats.experts.ONLINE_HADAMARD: routed_expert_passes reads it too
        self.register_buffer("gate_up_proj", gate_up.float(), persistent=False)  # (E, 2I, H)
        self.register_buffer("down_proj", down.float(), persistent=False)  # (E, H, I)
        self.register_buffer("quantized", quantized, persistent=False)  # (E, 2) bool: gate/up, down
        self.register_buffer("input_global_scale", input_global_scale, persistent=False)  # (E, 2) float32 or None

    def fake_quant_input(self, x: torch.Tensor, e: int, which: int) -> torch.Tensor:
        """Expert e's input `which` (0: gate/up, 1: down_proj) as its matmul reads it: quantized-dequantized
        (down_proj's online-transformed first in a rotated checkpoint, `quantizer_input`), float32."""
        x = self.quantizer_input(x, which)
        if not (self.quantize_activations and self.quantized[e, which]):
            return x.float()
        scale = None if self.input_global_scale is None else self.input_global_scale[e, which]
        return self.scheme.fake_quant_activation(x, scale)

    def quantizer_input(self, x: torch.Tensor, which: int) -> torch.Tensor:
        """Input `which` as its quantizer reads it: down_proj's (1) x (I (x) H_b) in float32 where the checkpoint's
        rotation puts an online Hadamard of block b on these experts, else x itself."""
        return block_hadamard(x, self.online_hadamard) if which == 1 and self.online_hadamard is not None else x

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden_states (T, H), top_k_index / top_k_weights (T, k) -> (T, H) in the input's dtype (class docstring)."""
        out = routed_experts_forward(
            hidden_states,
            top_k_index,
            top_k_weights,
            self.gate_up_proj,
            self.down_proj,
            self.act_fn,
            per_expert(self.fake_quant_input),
        )
        return out.to(hidden_states.dtype)


def _served_scheme(recipe: Recipe, name: str):
    """The scheme serving computes the recipe's Linear `name` with; None where the recipe keeps it unquantized."""
    return None if recipe.ignores(name) else scheme_for(recipe.scheme_of(name))


def quantized_product(recipe: Recipe, activations: bool = True) -> QuantizedProduct:
    """What serving computes for the recipe's Linear `name`, for SmoothQuant's alpha search
    (`quantkit.calibrate.alpha_search`): x (rows, K) and weight (N, K) float32 -> fake_quant(x) @
    fake_quant_weight(weight)^T, (rows, N) float32, with the module's scheme (`Recipe.scheme_of`), min-max weight
    scales and per-token activation scales (a static-scale recipe's scale is calibrated after smoothing: per token
    stands in); x @ weight^T for a module the recipe keeps unquantized. `activations` False: x stays float32
    (x @ fake_quant_weight(weight)^T; recipe key `smoothquant.search_weights_only`)."""

    def product(name: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        scheme = _served_scheme(recipe, name)
        if scheme is None:
            return x @ weight.T
        x_served = scheme.fake_quant_activation(x) if activations else x
        return x_served @ scheme.fake_quant_weight(weight, name).T

    return product


def quantized_weight(recipe: Recipe) -> QuantizedWeight:
    """The recipe's Linear `name` weight as served, decoded: weight (N, K) float32 -> fake_quant_weight(weight),
    (N, K) float32, with the module's scheme and min-max scales (the weight side of `quantized_product`); the
    weight itself for a module the recipe keeps unquantized. For the parent-output search
    (`quantkit.calibrate.alpha_search.choose_scales_by_parent`)."""

    def weight_as_served(name: str, weight: torch.Tensor) -> torch.Tensor:
        scheme = _served_scheme(recipe, name)
        return weight if scheme is None else scheme.fake_quant_weight(weight, name)

    return weight_as_served


def read_quantization_config(model_dir: str | Path) -> dict:
    """config.json's quantization_config, checked (quant_method quantkit, `scheme_from_config`)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    config, headers = check_checkpoint_dir(model_dir)
    qc = config.get("quantization_config")
    if qc is None:
        raise ValueError(f"{model_dir}: config.json has no quantization_config (not a quantized checkpoint)")
    if qc.get("quant_method") != "quantkit":
        raise ValueError(f"{model_dir}: quant_method {qc.get('quant_method')!r} is not 'quantkit'")
    scheme_from_config(qc, f"{config_path} quantization_config")
    check_quantized_tensors(model_dir, qc, headers)  # the tensors are what the config says
    return qc


def load_fake_quant_model(model_dir: str | Path, quantize_activations: bool = True) -> torch.nn.Module:
    """Model with FakeQuantLinear modules, from a quantkit-quantized checkpoint (float32, eval mode).

    quantize_activations=False gives the weight-only ablation (decoded weights, float32 activations)."""
    model_dir = Path(model_dir)
    qc = read_quantization_config(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation=reference_attention(config)
    ).eval()
    state = read_state(model_dir)  # one model.safetensors or shards with an index
    experts = list(fused_experts_modules(model))
    rest = install_fake_quant(model, "", state, qc, quantize_activations, model_dir)
    missing, unexpected = model.load_state_dict(rest, strict=False)
    loaded = set(qc["quantized_modules"]) | set(experts)  # set above
    missing = [k for k in missing if k.rsplit(".", 1)[0] not in loaded]
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is embeddings.weight:  # tied: the checkpoint stores the embedding once
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(
            f"{model_dir}: checkpoint inconsistent with its config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return model


def install_fake_quant(
    module: torch.nn.Module,
    prefix: str,
    state: dict[str, torch.Tensor],
    qc: dict,
    quantize_activations: bool,
    model_dir: Path,
    only: set[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Replace, in `module` (the model, or one of its submodules named prefix without its trailing dot), the
    quantized linears and the fused routed experts by FakeQuantLinear / FakeQuantExperts built from `state`
    (checkpoint tensors under their full names, e.g. a decoder layer's with prefix "model.layers.3."; popped).
    Returns the remaining tensors of `state` under `prefix`, renamed relative to `module`, for load_state_dict.
    qc: the checkpoint's quantization_config (`read_quantization_config`); only: full module names to consider
    (default: every quantized module and experts module under prefix)."""
    quantized = {n for n in qc["quantized_modules"] if n.startswith(prefix) and (only is None or n in only)}
    for name, experts in fused_experts_modules(module).items():  # their matrices are taken out of `quantized`
        if only is not None and prefix + name not in only:
            continue
        _load_experts(module, prefix, name, experts, qc, state, quantized, quantize_activations, model_dir)
    online = online_hadamard_blocks(qc)
    for full in sorted(quantized):
        scheme = module_scheme(qc, full)[0]
        name = full[len(prefix) :]
        linear = cast(torch.nn.Linear, module.get_submodule(name))  # a quantized module is a Linear
        tensors = {s: state.pop(f"{full}.{s}") for s in checkpoint_suffixes() if f"{full}.{s}" in state}
        weight = scheme.decode(tensors, linear.in_features)
        if tuple(weight.shape) != tuple(linear.weight.shape):
            raise ValueError(
                f"{model_dir}: {full} decodes to {tuple(weight.shape)}, the model expects {tuple(linear.weight.shape)}"
            )
        bias = state.pop(f"{full}.bias", None)
        fake = FakeQuantLinear(
            scheme, weight, bias, tensors.get("input_global_scale"), quantize_activations, online.get(full)
        )
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent), child, fake)
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _load_experts(
    model: torch.nn.Module,
    prefix: str,
    name: str,
    module: torch.nn.Module,
    qc: dict,
    state: dict[str, torch.Tensor],
    quantized: set[str],
    quantize_activations: bool,
    model_dir: Path,
) -> None:
    """Fill the fused experts module `name` of `model` (checkpoint names: prefix + name) from its per-expert
    checkpoint tensors (popped from `state` and, for quantized matrices, discarded from `quantized`); replace it
    by a FakeQuantExperts if any matrix is quantized (all of them in one scheme: one fused GEMM)."""
    shapes = {prefix + m: tuple(w.shape) for m, w in expert_matrices(name, module).items()}
    schemes = {module_scheme(qc, m)[0] for m in shapes if m in quantized}
    if len(schemes) > 1:
        raise ValueError(
            f"{model_dir}: the experts of {prefix + name} are quantized in {sorted(s.name for s in schemes)}; "
            "one experts module takes one scheme"
        )
    scheme = schemes.pop() if schemes else get_scheme(qc["scheme"])
    num_experts = cast(torch.Tensor, module.gate_up_proj).shape[0]
    matrices, scales, flags = {}, {}, {}
    for matrix, shape in shapes.items():
        if matrix in quantized:
            quantized.discard(matrix)
            tensors = {s: state.pop(f"{matrix}.{s}") for s in checkpoint_suffixes() if f"{matrix}.{s}" in state}
            matrices[matrix] = scheme.decode(tensors, shape[1])
            scales[matrix] = tensors.get("input_global_scale")
            flags[matrix] = True
        elif f"{matrix}.weight" in state:
            matrices[matrix], flags[matrix] = state.pop(f"{matrix}.weight").float(), False
        else:
            raise ValueError(f"{model_dir}: expert matrix {matrix} has no tensors in the checkpoint")
        if tuple(matrices[matrix].shape) != shape:
            raise ValueError(
                f"{model_dir}: {matrix} decodes to {tuple(matrices[matrix].shape)}, the model expects {shape}"
            )
    full = prefix + name
    gate_up, down = fuse_expert_matrices(matrices, full, num_experts)
    if not any(flags.values()):  # parameters replaced, not copied into: `module` may be on the meta device
        module.gate_up_proj, module.down_proj = torch.nn.Parameter(gate_up), torch.nn.Parameter(down)
        return
    for e in range(num_experts):
        if flags[f"{full}.{e}.gate_proj"] != flags[f"{full}.{e}.up_proj"]:
            raise ValueError(
                f"{model_dir}: {full}.{e}: gate_proj and up_proj must be quantized together (one fused GEMM)"
            )
    quant = torch.tensor([[flags[f"{full}.{e}.gate_proj"], flags[f"{full}.{e}.down_proj"]] for e in range(num_experts)])
    online = experts_online_block(online_hadamard_blocks(qc), full)
    static = None
    if any(v is not None for v in scales.values()):
        static = torch.tensor(
            [[_scale(scales, f"{full}.{e}.{p}") for p in ("gate_proj", "down_proj")] for e in range(num_experts)]
        )
    parent, _, child = name.rpartition(".")
    setattr(
        model.get_submodule(parent),
        child,
        FakeQuantExperts(
            scheme, gate_up, down, cast(torch.nn.Module, module.act_fn), quant, static, quantize_activations, online
        ),
    )


def _scale(scales: dict[str, torch.Tensor | None], matrix: str) -> float:
    value = scales.get(matrix)
    return float("nan") if value is None else value.item()  # NaN: never read (the matrix is not quantized)
