"""vLLM FusedMoE method for quantkit checkpoints: routed experts quantized per expert matrix.

`QuantkitQuantConfig.get_quant_method` returns a `QuantkitMoEMethod` for a FusedMoE layer (vLLM's
`RoutedExperts`) whose experts the checkpoint quantized (docs/checkpoint-format.md, "Routed experts"). Parameters,
per scheme tensor `<suffix>` (`Scheme.layer_tensors`), stacked over this rank's local experts E:

    w13_<suffix>   (E, *layout of a fused [gate; up] layer of 2 * I_p rows and H inputs)   shards w1 (gate), w3 (up)
    w2_<suffix>    (E, *layout of a layer of H rows and I_p inputs)                        down_proj

I_p = moe_intermediate_size / tensor-parallel size (w13 rows and w2 input columns are this rank's slice, as vLLM
shards experts); vLLM's expert mapping sends checkpoint `experts.<e>.gate_proj.<suffix>` to `w13_<suffix>` (shard
w1, global expert e; `expert_map` decides which rank holds it), `up_proj` to shard w3, `down_proj` to `w2_<suffix>`.

Kernel (logged at load like the Linear method's, QUANTKIT_KERNEL):
- "torch-emulation" (CPU): weights decoded once to float32; `quantkit.formats.experts.routed_experts_forward`,
  the transformers reference's own function: per expert hit, the block input quantized per token (or with the
  expert's static scale) before gate/up, act(gate) * up quantized again before down, float32 matmuls (in the
  summation order of the load: `quantkit.serve.cpu.linear.ordered_expert_linears`, the numerics floor's). Per-token
  quantization runs once per layer and input over all (token, expert) rows (it is row by row, so this equals one
  call per expert), static scales once per expert.
- "triton" (CUDA): the packed parameters above, kept as loaded, feed the grouped GEMMs
  (`quantkit.kernels.schemes.grouped_quantized_linear`, the FusedMoE forward of its docstring): the (token, slot)
  pairs sorted by expert (`sort_by_expert`), w13 on the gathered rows of x (each token quantized once, or each
  pair with its expert's static scale), act(gate) * up in float32, w2 on that (quantized per sorted row, or with
  the expert's static scale), `combine_expert_rows`. The same quantization points as the emulation, float32
  accumulation; it equals the emulation within float32 rounding (tests/test_quant_method_kernels.py, through the
  Triton interpreter; untested on a GPU so far). The FP8 weight_scale (E, N, ceil(K/128)) rows and NVFP4
  weight_global_scale (E, N) rows are the grouped GEMMs' per-row layouts as stored.
A rotated checkpoint (`quantization_config.rotation.online_hadamard` names every expert's down_proj, one block b):
act(gate) * up is transformed before it is quantized for w2, as the reference does: by the torch butterfly
(`quantkit.formats.hadamard.block_hadamard`) in the emulation and when the reference quantizes a TP slice, inside the
fused quantizer kernel on the "triton" path (bit-exact with the butterfly). Under tensor parallelism the down
input is a slice of I (b must divide I_p: each rank transforms its own slice): its per-token amax is all-reduced
(max) over the TP group on both kernels, so the scales equal the unsharded model's. Parity capture
(QUANTKIT_CAPTURE_DIR) is torch-emulation only.
The shared expert is an ordinary MLP of Linear layers (served by `QuantkitLinearMethod`); vLLM runs it before the
routed experts.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.distributed import get_tp_group
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

from quantkit.formats.constants import ActivationScale
from quantkit.formats.experts import ExpertLinears, Segments, routed_experts_forward
from quantkit.formats.hadamard import block_hadamard
from quantkit.formats.schemes import LayerTensor, experts_online_block
from quantkit.kernels.expert_sort import ExpertSort, combine_expert_rows, sort_by_expert
from quantkit.serve import method_parts
from quantkit.serve.cpu.linear import ordered_expert_linears, summation_order
from quantkit.serve.method_parts import CAPTURE_ENV, Kernel, copy_checkpoint_part, emulated_activation, select_kernel

logger = init_logger(f"vllm.{__name__}")

ACTIVATIONS = {MoEActivation.SILU: F.silu}  # Qwen3-Next's experts; GLU experts are served by serve/hybrid.py
SHARD_INDEX = {"w1": 0, "w3": 1, "w2": 0}  # vLLM's expert shard id -> fused shard of its parameter


def _layout(layer: torch.nn.Module) -> dict[str, tuple[list[int], int]]:
    """The quantkit_layout `QuantkitExperts.create_weights` set on `layer`: stem -> (its shards' rows, in_features)."""
    return cast(dict[str, tuple[list[int], int]], layer.quantkit_layout)


def _num_experts(layer: torch.nn.Module) -> int:
    """The quantkit_num_experts `QuantkitExperts.create_weights` set on `layer`."""
    return cast(int, layer.quantkit_num_experts)


class QuantkitExperts:
    """The quantized routed experts of one MoE layer, framework-neutral: registers the parameters on a layer, loads
    vLLM's per-expert shards into them, decodes after loading, and computes the experts (torch emulation). Used by
    `QuantkitMoEMethod` (vLLM's FusedMoE) and by `quantkit.serve.hybrid.GLUExperts` (GLU experts, which vLLM's fused
    kernels do not implement)."""

    def __init__(self, config, prefix: str, tp_rank: int = 0, tp_size: int = 1) -> None:
        self.scheme, self.activation_scale = config.experts_scheme(prefix)  # mixed precision: this layer's
        self.prefix, self.tp_rank, self.tp_size = prefix, tp_rank, tp_size
        self.online_hadamard = experts_online_block(config.online_hadamard, prefix)  # rotated: down input's block
        self.kernel: Kernel | None = None  # chosen after loading (select_kernel)
        self.capture_dir = os.environ.get(CAPTURE_ENV)
        self.calls = 0
        self.input_scales: torch.Tensor | None = None  # static activations: (E, 2) gate/up input, down input
        self.expert_linears: ExpertLinears | None = None  # torch-emulation: products in a second order, or None

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        local_expert: Callable[[int], int],
    ) -> None:
        """Register `w13_<suffix>` / `w2_<suffix>` (module docstring); intermediate_size is this rank's I_p;
        local_expert maps a global expert id to this rank's index (-1: not held here)."""
        advice = "quantize with a smaller rotation.online_block"
        method_parts.check_rank_width(self, intermediate_size, "moe_intermediate_size/tp", self.tp_size > 1, advice)
        # (the ignores: nn.Module.__setattr__ takes any value; torch's stub admits only tensors and modules)
        layer.quantkit_layout = {  # type: ignore[assignment]
            "w13": ([intermediate_size] * 2, hidden_size),
            "w2": ([hidden_size], intermediate_size),
        }
        layer.quantkit_num_experts = num_experts  # type: ignore[assignment]
        for stem, (shard_rows, k) in _layout(layer).items():
            for spec in self.scheme.layer_tensors(sum(shard_rows), k, len(shard_rows), self.activation_scale):
                self._add(layer, stem, spec, shard_rows, num_experts, local_expert)

    def _add(
        self,
        layer: torch.nn.Module,
        stem: str,
        spec: LayerTensor,
        shard_rows: list[int],
        num_experts: int,
        local_expert: Callable[[int], int],
    ) -> None:
        """Register `<stem>_<suffix>` (E, *spec.shape) with a loader for vLLM's per-expert mapping."""
        param = Parameter(torch.empty((num_experts, *spec.shape), dtype=spec.dtype), requires_grad=False)
        name = f"{stem}_{spec.suffix}"

        def weight_loader(
            param: Parameter,
            loaded_weight: torch.Tensor,
            weight_name: str,
            shard_id: str,
            expert_id: int,
            return_success: bool = False,
        ) -> bool | None:
            local = local_expert(expert_id)
            if local == -1:  # another rank's expert
                return False if return_success else None
            k_rank = self.tp_rank if stem == "w2" and self.tp_size > 1 else None
            rank_shard = self.tp_rank if stem == "w13" else 0
            copy_checkpoint_part(
                param.data[local],
                loaded_weight,
                spec,
                shard_rows,
                SHARD_INDEX[shard_id],
                rank_shard,
                k_rank,
                f"{self.prefix}.{name} (expert {expert_id}, shard {shard_id})",
                self.scheme.name,
            )
            return True if return_success else None

        # vLLM's loading protocol: a weight_loader attribute on the Parameter (no such attribute in torch's stub)
        param.weight_loader = weight_loader  # type: ignore[attr-defined]
        layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check static scales, pick the kernel; torch-emulation: decode every expert matrix to float32
        (`w13/w2_dequantized`), triton: keep the packed parameters."""
        scheme = self.scheme
        if self.activation_scale == ActivationScale.STATIC:
            w13_scales = cast(Parameter, layer.w13_input_global_scale).data
            if not torch.equal(w13_scales[:, 0], w13_scales[:, 1]):
                raise ValueError(
                    f"{self.prefix}: experts' gate_proj and up_proj have different static "
                    "input_global_scale; they read the same input"
                )
            w2_scales = cast(Parameter, layer.w2_input_global_scale).data
            self.input_scales = torch.stack([w13_scales[:, 0], w2_scales[:, 0]], 1)
        self.kernel = select_kernel(layer)
        if self.kernel == Kernel.TORCH_EMULATION:
            for stem, (_, k) in _layout(layer).items():
                params = {s: getattr(layer, f"{stem}_{s}").data for s in scheme.tensors}
                decoded = torch.stack(
                    [scheme.decode_layer({s: t[e] for s, t in params.items()}, k) for e in range(_num_experts(layer))]
                )
                for s in (*scheme.tensors, *scheme.static_tensors):
                    if hasattr(layer, f"{stem}_{s}"):
                        delattr(layer, f"{stem}_{s}")
                layer.register_parameter(f"{stem}_dequantized", Parameter(decoded, requires_grad=False))
            # the summation order of this process (the numerics stage's second order on CPUs; default on GPUs)
            w13, w2 = cast(Parameter, layer.w13_dequantized).data, cast(Parameter, layer.w2_dequantized).data
            self.expert_linears = ordered_expert_linears(w13, w2, "default" if w13.is_cuda else summation_order())
        logger.info(
            "quantkit: %s experts=%d scheme=%s activations=%s kernel=%s",
            self.prefix,
            layer.quantkit_num_experts,
            scheme.name,
            self.activation_scale,
            self.kernel,
        )

    def forward(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        act: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """x (T, H), topk_ids (T, k) local expert ids (-1: not here), topk_weights (T, k) -> (T, H) in x's dtype."""
        if self.kernel == Kernel.TORCH_EMULATION:
            w13, w2 = cast(Parameter, layer.w13_dequantized), cast(Parameter, layer.w2_dequantized)
            out = routed_experts_forward(x, topk_ids, topk_weights, w13, w2, act, self._fake_quant, self.expert_linears)
            return out.to(x.dtype)
        sort = sort_by_expert(topk_ids, _num_experts(layer))
        gate, up = self.triton_gate_up(layer, x, sort).chunk(2, dim=-1)
        y = self._grouped(layer, "w2", act(gate) * up, sort.expert_offsets, 1)
        return combine_expert_rows(y, sort, topk_weights).to(x.dtype)

    def triton_gate_up(self, layer: torch.nn.Module, x: torch.Tensor, sort: ExpertSort) -> torch.Tensor:
        """The "triton" kernel's w13 projection, float32 (S, 2 I_p) = [gate | up] of each (token, slot) pair in
        `sort`'s order (`quantkit.kernels.expert_sort.ExpertSort` of this call's topk_ids); zeros for pairs of no
        local expert."""
        return self._grouped(layer, "w13", x, sort.expert_offsets, 0, sort.token_index)

    def _grouped(
        self,
        layer: torch.nn.Module,
        stem: str,
        x: torch.Tensor,
        expert_offsets: torch.Tensor,
        which: int,
        token_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Grouped GEMM of `<stem>_<suffix>` over sorted rows, float32 (S, N); `which` as in `_fake_quant`. A rotated
        checkpoint's down input is transformed inside the fused quantizer, or first by `_down_input` when the
        reference quantizes a tensor-parallel slice (row_amax)."""
        from quantkit.kernels.schemes import grouped_quantized_linear  # Triton: imported where used

        scale = None if self.input_scales is None else self.input_scales[:, which]
        hadamard = (self.online_hadamard or 0) if which == 1 else 0
        if hadamard and scale is None and self.tp_size > 1:
            x, hadamard = self._down_input(x), 0
        row_amax = self._row_amax(x) if which == 1 and scale is None else None
        weights = [getattr(layer, f"{stem}_{s}") for s in self.scheme.tensors]
        return grouped_quantized_linear(
            self.scheme,
            x,
            expert_offsets,
            weights,
            token_index=token_index,
            input_global_scale=scale,
            row_amax=row_amax,
            hadamard=hadamard,
            out_dtype=torch.float32,
        )

    def _down_input(self, rows: torch.Tensor) -> torch.Tensor:
        """act(gate) * up as w2's quantizer reads it: transformed by the online Hadamard in a rotated checkpoint."""
        return rows if self.online_hadamard is None else block_hadamard(rows, self.online_hadamard)

    def _row_amax(self, rows: torch.Tensor) -> torch.Tensor | None:
        """Per-token max |x| (rows, 1) of the down input over the whole intermediate under tensor parallelism (this
        rank holds a slice of I; all-reduced, max, over the TP group), None without it (the rows are whole)."""
        if self.tp_size == 1:
            return None
        row_amax = rows.float().abs().amax(dim=-1, keepdim=True)
        torch.distributed.all_reduce(row_amax, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().device_group)
        return row_amax

    def _fake_quant(self, rows: torch.Tensor, segments: Segments, which: int) -> torch.Tensor:
        """The scheme's activation quantize-dequantize of input `which` (0: gate/up, 1: down) of the rows of each
        expert segment (`quantkit.quantize.fake_quant.RowsQuantizer`): per token, one call for all rows (the
        quantization is row by row); static, one call per expert with its scale. The down input is transformed first
        in a rotated checkpoint (`_down_input`)."""
        if which == 1:
            rows = self._down_input(rows)
        if self.input_scales is None:
            row_amax = self._row_amax(rows) if which == 1 else None
            xq = emulated_activation(self.scheme, rows, None, row_amax)
        else:
            xq = torch.cat(
                [
                    emulated_activation(self.scheme, rows[start:stop], self.input_scales[e, which], None)
                    for e, start, stop in segments
                ]
            )
        if self.capture_dir:
            for e, start, stop in segments:
                name = f"{self.prefix}.{e}.{('gate_up', 'down')[which]}"
                path = os.path.join(self.capture_dir, f"{name}.{self.tp_rank}.{self.calls:05d}.pt")
                torch.save(
                    {
                        "prefix": name,
                        "tp_rank": self.tp_rank,
                        "x": rows[start:stop].float().clone(),
                        "xq": xq[start:stop].clone(),
                    },
                    path,
                )
                self.calls += 1
        return xq


class QuantkitMoEMethod(FusedMoEMethodBase):
    """vLLM's FusedMoE method interface over `QuantkitExperts` (SiLU-gated experts: Qwen3-Next's)."""

    def __init__(self, config, moe: FusedMoEConfig, prefix: str) -> None:
        super().__init__(moe)
        if moe.activation not in ACTIVATIONS or not moe.is_act_and_mul:
            raise ValueError(
                f"{prefix}: quantkit's FusedMoE method serves gated experts with "
                f"{[a.value for a in ACTIVATIONS]}, not {moe.activation.value!r}"
            )
        parallel = moe.moe_parallel_config
        self.experts = QuantkitExperts(config, prefix, parallel.tp_rank, parallel.tp_size)

    @property
    def kernel(self) -> Kernel | None:
        """The experts' kernel, None until the weights are loaded."""
        return self.experts.kernel

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        """vLLM: register w13_<suffix> / w2_<suffix> for this rank's experts (`QuantkitExperts.create_weights`,
        I_p = intermediate_size_per_partition); params_dtype unused (the scheme's dtypes). The expert map reaches
        the layer through a weak reference: the loaders hold it, and a loader holding the layer keeps it alive after
        its engine (`QuantkitLinearMethod._add` says why)."""
        layer_ref = weakref.ref(layer)
        self.experts.create_weights(
            layer,
            num_experts,
            hidden_size,
            intermediate_size_per_partition,
            lambda expert_id: cast(RoutedExperts, layer_ref())._map_global_expert_id_to_local_expert_id(expert_id),
        )

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """vLLM: check static scales, pick the kernel, decode to float32 for torch-emulation (`QuantkitExperts`)."""
        self.experts.process_weights_after_loading(layer)

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> FusedMoEQuantConfig | None:
        """vLLM: None, no modular-kernel config: `apply` computes the experts itself."""
        return None  # no vLLM modular kernel: `apply` computes the experts itself

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts=None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Routed experts' output (T, H) in x's dtype; vLLM adds the shared expert (run before) and reduces over TP."""
        ids = topk_ids.long()
        if layer.expert_map is not None:  # global -> local expert ids (-1: another rank's)
            ids = cast(torch.Tensor, layer.expert_map)[ids].long()
        return self.experts.forward(layer, x, ids, topk_weights, ACTIVATIONS[layer.activation])


class QuantkitGLUExpertsMethod(QuantizeMethodBase):
    """Quantized GLU experts (`quantkit.serve.hybrid.GLUExperts`, sigmoid gates: vLLM's fused kernels implement
    none): `QuantkitExperts` on a layer that is replicated across tensor-parallel ranks (every rank all experts)."""

    def __init__(self, config, prefix: str) -> None:
        super().__init__()
        self.experts = QuantkitExperts(config, prefix)

    def create_weights(
        self, layer: torch.nn.Module, num_experts: int, hidden_size: int, intermediate_size: int
    ) -> None:
        """Register w13_<suffix> / w2_<suffix> for all `num_experts` (replicated: local id = global id; whole I)."""
        self.experts.create_weights(layer, num_experts, hidden_size, intermediate_size, lambda e: e)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check static scales, pick the kernel, decode to float32 for torch-emulation (`QuantkitExperts`)."""
        self.experts.process_weights_after_loading(layer)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """x (T, H), topk_ids / topk_weights (T, k) -> the routed GLU experts' output (T, H) in x's dtype."""
        return self.experts.forward(layer, x, topk_ids, topk_weights, torch.sigmoid)
