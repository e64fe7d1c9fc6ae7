"""vLLM quantization method `quant_method: "quantkit"` (checkpoints from `quantkit quantize`).

Registered by the plugin (`quantkit.serve.plugin.register`). Serves every scheme of `quantkit.formats.schemes`
(docs/checkpoint-format.md) in any vLLM Linear (fused qkv_proj / gate_up_proj, column / row parallel); the
scheme object says which parameters a layer holds (`Scheme.layer_tensors`, per TP partition: N = output rows
of this rank, K = its input columns), how they decode and how activations are quantized. Fused layers hold
the checkpoint's block scales repeated over the rows of each block (so that the shards q, k, v or gate, up
need not be multiples of 128 rows) and each shard's per-tensor scales repeated over its rows.

Kernels (logged per layer at load; QUANTKIT_KERNEL=auto|triton|torch):
- "torch-emulation" (CPU): weights decoded once to float32 at load with `quantkit.formats`, activations
  quantized and decoded on every call with the same functions, matmul in float32 -- the numerics of the
  transformers fake-quant reference (`quantkit.quantize.fake_quant`) bit for bit; in $QUANTKIT_CPU_SUMMATION's
  order where the numerics stage sets a second one (`quantkit.serve.cpu.linear.ordered_linear`);
- "triton" (CUDA): `quantkit.kernels.schemes` -- the scheme's fused activation quantizer, then the FP8 block
  GEMM or the NVFP4 GEMM on the packed weights (bf16 MMA, float32 accumulation). Untested on a GPU so far; its
  kernels are tested through the Triton interpreter and this dispatch by tests/test_quant_method_kernels.py.
Under tensor parallelism a row-parallel layer holds a slice of K: the per-token amax is all-reduced (max)
over the TP group first, so the scales equal those of the unsharded model.

Parity capture (torch-emulation only; for tests/test_serve_quantized.py): with QUANTKIT_CAPTURE_DIR set, every
call of a quantized layer saves {"prefix", "tp_rank", "x" (its input, float32), "xq" (the dequantized quantized
input the matmul reads)} to `<dir>/<prefix>.<rank>.<call:05d>.pt`, so a reference can hold its activation codes
equal to the served ones.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, cast

import torch
from torch.nn import Parameter
from vllm.distributed import get_tp_group
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from quantkit.formats.constants import ActivationScale
from quantkit.formats.experts import EXPERT_MATRIX
from quantkit.formats.hadamard import block_hadamard
from quantkit.formats.schemes import LayerTensor, Scheme, module_scheme, online_hadamard_blocks, scheme_from_config
from quantkit.serve import method_parts
from quantkit.serve.cpu.linear import Linear, ordered_linear, summation_order
from quantkit.serve.method_parts import CAPTURE_ENV, Kernel, copy_checkpoint_part, emulated_activation, select_kernel
from quantkit.serve.moe_method import QuantkitMoEMethod

logger = init_logger(f"vllm.{__name__}")  # under "vllm": vLLM configures that logger tree


@register_quantization_config("quantkit")
class QuantkitQuantConfig(QuantizationConfig):
    """The `quantization_config` of a quantkit checkpoint (docs/checkpoint-format.md)."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.scheme = scheme_from_config(config)
        self.activation_scale = config["activation_scale"]
        self.quantized_modules = set(config["quantized_modules"])
        self.module_schemes: dict[str, str] = dict(config.get("module_schemes") or {})  # mixed precision by module
        self.online_hadamard = online_hadamard_blocks(config)  # rotated checkpoints: {module: Hadamard block}
        self.recipe = config.get("recipe", "?")
        self.smoothquant = config.get("smoothquant")  # the recipe's SmoothQuant settings, None without it

    @classmethod
    def get_name(cls) -> str:
        """vLLM: the quant_method this config serves, "quantkit"."""
        return "quantkit"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        """vLLM: activation dtypes served: float32, bfloat16, float16."""
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        """vLLM: CUDA compute capability 89 at least (8.9: FP8 tensor cores, Ada / Hopper) for the Triton kernels."""
        return 89  # CUDA: FP8 tensor cores (Ada / Hopper) for the Triton kernels

    @staticmethod
    def get_config_filenames() -> list[str]:
        """vLLM: no extra files; the quantization_config is read from config.json."""
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantkitQuantConfig:
        """vLLM: the checkpoint's quantization_config -> this config."""
        return cls(config)

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        """vLLM hands the model class's renames (checkpoint names -> its module names, e.g. Mixtral's
        mlp.experts -> block_sparse_moe.experts, `quantkit.serve.stock_names`): the quantized module names follow."""
        self.quantized_modules = set(hf_to_vllm_mapper.apply_list(sorted(self.quantized_modules)))
        self.module_schemes = {hf_to_vllm_mapper.apply_list([m])[0]: s for m, s in self.module_schemes.items()}
        self.online_hadamard = {hf_to_vllm_mapper.apply_list([m])[0]: b for m, b in self.online_hadamard.items()}

    def scheme_of(self, names: list[str], prefix: str) -> tuple[Scheme, str]:
        """(scheme, activation scale) of the checkpoint modules `names` that vLLM serves as the layer `prefix`
        (`module_scheme`); ValueError when they differ (one layer, one GEMM)."""
        config = {
            "scheme": self.scheme.name,
            "activation_scale": self.activation_scale,
            "module_schemes": self.module_schemes,
        }
        schemes = {module_scheme(config, n) for n in names}
        if len(schemes) > 1:
            raise ValueError(
                f"{prefix}: vLLM serves {names} as one layer, but the checkpoint quantized them in "
                f"{sorted(s.name for s, _ in schemes)}; one scheme per fused layer"
            )
        return schemes.pop()

    def online_block_of(self, names: list[str], prefix: str) -> int | None:
        """The online Hadamard block of the input of the layer `prefix` that vLLM serves for the checkpoint modules
        `names` (a fused layer's shards read one input: one block), None for none; ValueError when the shards
        disagree (some transformed, some not, or different blocks)."""
        blocks = {self.online_hadamard.get(n) for n in names}
        if len(blocks) > 1:
            raise ValueError(
                f"{prefix}: vLLM serves {names} as one layer reading one input, but the checkpoint's online "
                f"Hadamard blocks differ ({[self.online_hadamard.get(n) for n in names]})"
            )
        return blocks.pop()

    def checkpoint_names(self, prefix: str) -> list[str]:
        """vLLM layer prefix -> the checkpoint's module names (a fused layer has one per shard)."""
        parent, _, leaf = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(leaf, [leaf])
        return [f"{parent}.{s}" if parent else s for s in shards]

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """vLLM: routed experts -> `_experts_method`; a Linear -> QuantkitLinearMethod when the checkpoint quantized
        all its modules, UnquantizedLinearMethod when none (ValueError when some); any other layer -> None."""
        if isinstance(layer, RoutedExperts):
            return self._experts_method(layer, prefix)
        if not isinstance(layer, LinearBase):
            return None
        names = self.checkpoint_names(prefix)
        quantized = [n in self.quantized_modules for n in names]
        if not any(quantized):
            return UnquantizedLinearMethod()
        if not all(quantized):
            raise ValueError(
                f"{prefix}: vLLM fuses {names} into one layer, but the checkpoint quantized only "
                f"{[n for n, q in zip(names, quantized) if q]}; quantize all of them or none"
            )
        return QuantkitLinearMethod(self, prefix)

    def _experts_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """QuantkitMoEMethod when the checkpoint quantized this layer's experts, None (vLLM's unquantized method)
        when it kept them all in the source precision; the checker refuses partly quantized experts."""

        return QuantkitMoEMethod(self, layer.moe_config, prefix) if self.quantizes_experts(prefix) else None

    def experts_scheme(self, prefix: str) -> tuple[Scheme, str]:
        """(scheme, activation scale) of the quantized routed experts under `prefix` (all in one: `scheme_of`)."""
        names = sorted(m for m in self.quantized_modules if EXPERT_MATRIX.match(m) and m.startswith(f"{prefix}."))
        return self.scheme_of(names, prefix) if names else (self.scheme, self.activation_scale)

    def quantizes_experts(self, prefix: str) -> bool:
        """Whether the checkpoint quantized the routed experts under `prefix` (e.g. model.layers.0.mlp.experts)."""
        return any(EXPERT_MATRIX.match(m) and m.startswith(f"{prefix}.") for m in self.quantized_modules)


class QuantkitLinearMethod(LinearMethodBase):
    """One quantized Linear (possibly fused); see the module docstring for its parameters."""

    def __init__(self, config: QuantkitQuantConfig, prefix: str) -> None:
        self.config = config
        self.prefix = prefix
        # this layer's scheme (mixed precision by module: `module_schemes`; fused shards must agree)
        self.scheme, self.activation_scale = config.scheme_of(config.checkpoint_names(prefix), prefix)
        # a rotated down_proj (or, without a residual rotation, any quantized layer): its input's Hadamard block
        whole = prefix in config.quantized_modules  # stored as one matrix (Phi-3's qkv_proj), or its shards' names
        self.online_hadamard = config.online_block_of([prefix] if whole else config.checkpoint_names(prefix), prefix)
        self.kernel: Kernel | None = None  # chosen after loading (select_kernel)
        self.emulated_linear: Linear = torch.nn.functional.linear  # torch-emulation's matmul (process_weights_...)
        self.capture_dir = os.environ.get(CAPTURE_ENV)
        self.calls = 0

    # ------------------------------------------------------------------ parameters and their loading

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        """vLLM: register the scheme's `layer_tensors` for this partition (n = sum(output_partition_sizes),
        k = input_size_per_partition), each with a loader for its checkpoint shards; params_dtype unused."""
        n, k = sum(output_partition_sizes), input_size_per_partition
        sharded_k = isinstance(layer, RowParallelLinear) and layer.tp_size > 1
        # a fused layer the checkpoint stores as one matrix (Phi-3's qkv_proj, gate_up_proj): one shard, whole
        # (the ignores: nn.Module.__setattr__ takes any value; torch's stub admits only tensors and modules)
        layer.quantkit_whole = len(output_partition_sizes) > 1 and self.prefix in self.config.quantized_modules  # type: ignore[assignment]
        if layer.quantkit_whole and cast(int, layer.tp_size) > 1:
            raise ValueError(
                f"{self.prefix}: the checkpoint quantized this fused projection as one matrix; tensor "
                "parallelism splits it by its parts, whose scales the whole matrix shares: serve with tp 1"
            )
        layer.quantkit_shards = [n] if layer.quantkit_whole else list(output_partition_sizes)  # type: ignore[assignment]
        layer.quantkit_in_features = k  # type: ignore[assignment]
        scheme = self.scheme
        advice = "serve with a tensor-parallel size that keeps whole blocks per rank"
        method_parts.check_rank_width(self, k, "in_features/tp" if sharded_k else "in_features", sharded_k, advice)
        shards = len(cast(list[int], layer.quantkit_shards))
        for spec in scheme.layer_tensors(n, k, shards, self.activation_scale):
            self._add(layer, spec)

    def _add(self, layer: torch.nn.Module, spec: LayerTensor) -> None:
        """Register `spec` on the layer with a loader that copies this rank's part of a checkpoint tensor into it."""
        param = Parameter(torch.empty(spec.shape, dtype=spec.dtype), requires_grad=False)
        prefix, name = self.prefix, spec.suffix
        layer_ref = weakref.ref(layer)  # a strong reference would keep the layer alive after its engine (below)

        def weight_loader(param: Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
            layer = cast(torch.nn.Module, layer_ref())
            index, rank_shard = _shard_of(layer, shard_id, prefix)
            k_rank = layer.tp_rank if isinstance(layer, RowParallelLinear) and layer.tp_size > 1 else None
            copy_checkpoint_part(
                param.data,
                loaded,
                spec,
                cast(list[int], layer.quantkit_shards),
                index,
                rank_shard,
                k_rank,
                f"{prefix}.{name} (shard {shard_id})",
                self.scheme.name,
            )

        # vLLM's loading protocol: a weight_loader attribute on the Parameter (no such attribute in torch's stub).
        # vLLM keeps a copy of each parameter's attributes in LAYERWISE_INFO, a WeakKeyDictionary keyed by the layer
        # (model_loader/reload), and frees an entry only when its key dies: a loader holding the layer strongly
        # kept every layer of every engine alive, with its float32 weights (+1.3 GB per coder engine in a study).
        param.weight_loader = weight_loader  # type: ignore[attr-defined]
        layer.register_parameter(name, param)

    # ------------------------------------------------------------------ after loading: pick the kernel

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """vLLM: keep one static input_global_scale (the fused shards' must agree), pick the kernel; torch-emulation
        decodes the weight once to float32 (N, K) `weight_dequantized`."""
        if self.activation_scale == ActivationScale.STATIC:
            scales = cast(Parameter, layer.input_global_scale).data
            if not torch.all(scales == scales[0]):
                raise ValueError(
                    f"{self.prefix}: fused shards have different static input_global_scale {scales.tolist()}; "
                    "they read the same input"
                )
            layer.input_global_scale = Parameter(scales[:1].clone(), requires_grad=False)
        self.kernel = select_kernel(layer)
        if self.kernel == Kernel.TORCH_EMULATION:  # decode the weights once; activations are quantized per call
            scheme = self.scheme
            weight = scheme.decode_layer(
                {s: getattr(layer, s).data for s in scheme.tensors}, cast(int, layer.quantkit_in_features)
            )
            for suffix in scheme.tensors:
                delattr(layer, suffix)
            layer.weight_dequantized = Parameter(weight, requires_grad=False)
            # the summation order of this process (the numerics stage's second order on CPUs; default on GPUs)
            order = "default" if weight.is_cuda else summation_order()
            self.emulated_linear = ordered_linear(weight, order)
        logger.info(
            "quantkit: %s scheme=%s activations=%s kernel=%s",
            self.prefix,
            self.scheme.name,
            self.activation_scale,
            self.kernel,
        )

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., K) -> (..., N) in x's dtype: a rotated checkpoint's online Hadamard (float32), activations
        quantized per token (or static), then the chosen kernel's GEMM, + bias. The Triton kernels fuse the
        Hadamard into the activation quantizer (bit-exact with the torch butterfly) unless x is a TP slice of
        a per-token row (its whole-row amax needs the transformed slice first)."""
        dtype = x.dtype
        input_global_scale = getattr(layer, "input_global_scale", None)
        hadamard = self.online_hadamard or 0  # per rank: blocks never straddle a TP slice (create_weights)
        if hadamard and (self.kernel == Kernel.TORCH_EMULATION or _is_row_slice(layer, input_global_scale)):
            x, hadamard = block_hadamard(x, hadamard), 0
        row_amax = _row_amax(layer, x, input_global_scale)
        if self.kernel == Kernel.TORCH_EMULATION:
            xq = emulated_activation(self.scheme, x, input_global_scale, row_amax)
            if self.capture_dir:
                self._capture(layer, x, xq)
            weight = cast(Parameter, layer.weight_dequantized)
            out = self.emulated_linear(xq, weight, None if bias is None else bias.float())
            return out.to(dtype)
        from quantkit.kernels.schemes import quantized_linear  # Triton: imported where used

        weights = [getattr(layer, s) for s in self.scheme.tensors]
        return quantized_linear(self.scheme, x, weights, bias, input_global_scale, row_amax, hadamard).to(dtype)

    def _capture(self, layer: torch.nn.Module, x: torch.Tensor, xq: torch.Tensor) -> None:
        """Save this call's input and quantized input (see the module docstring, "Parity capture")."""
        rank = getattr(layer, "tp_rank", 0)
        capture_dir = cast(str, self.capture_dir)  # apply() captures only when it is set
        path = os.path.join(capture_dir, f"{self.prefix}.{rank}.{self.calls:05d}.pt")
        torch.save({"prefix": self.prefix, "tp_rank": rank, "x": x.float().clone(), "xq": xq.clone()}, path)
        self.calls += 1


def _is_row_slice(layer: torch.nn.Module, input_global_scale: torch.Tensor | None) -> bool:
    """True where x is this rank's slice of K of a per-token quantized row (a row-parallel layer under TP)."""
    return input_global_scale is None and isinstance(layer, RowParallelLinear) and layer.tp_size > 1


def _row_amax(layer: torch.nn.Module, x: torch.Tensor, input_global_scale: torch.Tensor | None) -> torch.Tensor | None:
    """Per-token amax over the WHOLE input row for a row-parallel layer under TP (each rank holds a slice
    of K), so that per-token scales equal the unsharded model's; None where x is the whole row."""
    if not _is_row_slice(layer, input_global_scale):
        return None
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().device_group)
    return amax


def _shard_of(layer: torch.nn.Module, shard_id: str | int | None, prefix: str) -> tuple[int, int]:
    """(index of the fused shard in this layer, which TP slice of that shard's rows this rank holds)."""
    if getattr(layer, "quantkit_whole", False):
        if shard_id is not None:
            raise ValueError(
                f"{prefix}: the checkpoint stores this fused projection as one matrix (got shard {shard_id!r})"
            )
        return 0, 0  # tp 1 (create_weights refuses more)
    if isinstance(layer, QKVParallelLinear):
        if shard_id not in ("q", "k", "v"):
            raise ValueError(
                f"{prefix}: a quantkit checkpoint stores q_proj, k_proj, v_proj separately (got shard {shard_id!r})"
            )
        index = "qkv".index(shard_id)
        return index, layer.tp_rank if shard_id == "q" else layer.tp_rank // layer.num_kv_head_replicas
    if isinstance(layer, MergedColumnParallelLinear):
        if shard_id is None and len(layer.output_sizes) == 1:  # one checkpoint tensor, e.g. DeltaNet's in_proj_qkvz
            return 0, layer.tp_rank
        if not isinstance(shard_id, int):
            raise ValueError(
                f"{prefix}: a quantkit checkpoint stores the fused projections separately (got shard {shard_id!r})"
            )
        return shard_id, layer.tp_rank
    if isinstance(layer, ColumnParallelLinear):
        return 0, layer.tp_rank
    return 0, 0  # RowParallelLinear (rows not sharded), ReplicatedLinear
