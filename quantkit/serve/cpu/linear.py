"""Unquantized bf16/fp16 Linears computed in float32 on CPUs where that is the faster matmul.

vLLM 0.32's CPU GEMM dispatch for unquantized layers (`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`)
tries oneDNN, whose bf16 matmul primitive needs AVX-512 BF16 / AMX / Arm BF16. Every served model's unquantized
layers take that dispatch: embeddings' tied LM heads, routers, the bf16 rows of a study, the layers a recipe leaves
unquantized. Two cases where a float32 matmul of the same shape is faster (figures: benchmarks/README.md,
"Measurements behind design choices"):

- no bf16 matmul at all (AVX2): `create_onednn_mm` refuses and vLLM falls back to `F.linear` in bf16, which
  PyTorch's CPU backend runs far slower than float32. Every call then computes in float32.
- Intel AVX-512 BF16 without AMX: oneDNN's bf16 kernel stays near 165 GFLOP/s on 2 cores at any batch, float32
  reaches 220-290 from 64 rows on (1.3-1.9x; below 32 rows bf16 is up to 2x faster). Calls with at least
  `FLOAT32_MIN_ROWS` rows (prefill chunks, batched decoding, prompt log-likelihoods) compute in float32, smaller
  ones on vLLM's own kernel. Not on AMD CPUs with AVX-512 BF16 (Zen 4 / 5: `amd_avx512_bf16`): there oneDNN's
  bf16 kernel reaches 560-880 GFLOP/s and the float32 `F.linear` (MKL, AVX2 code on AMD) 100-190, so every call
  stays on vLLM's kernel (`QUANTKIT_CPU_FLOAT32_LINEAR=on` restores the float32 rule there).

The emulated rows' float32 GEMMs (`default_linear`) run on `F.linear`, except on those AMD CPUs, where oneDNN's
float32 matmul (vLLM's `onednn_mm`, 280-400 GFLOP/s against MKL's 110-180) computes them
(`QUANTKIT_CPU_FLOAT32_GEMM=torch|onednn` chooses). Each kernel sums in its own order: `cpu_kernels()` names the
choice, recorded beside every evaluation, and a study does not mix rows computed with different ones.

`install()` (called by the plugin in every vLLM process) wraps the dispatch: the layer gets a float32 copy of its
weight (and bias), and computes `F.linear(x.float(), w32, b32)` rounded to the input dtype once. Same products (a
product of two bf16 numbers is exact in float32) and float32 accumulation as the bf16 kernels, only another
summation order; tests/test_cpu_linear.py bounds the difference. Memory: the float32 copy (4 bytes a parameter)
replaces the bf16 weight where vLLM drops it and no other kernel is kept (the AVX2 case), else sits beside vLLM's
own (the AVX-512 BF16 case: 6 bytes a parameter for these layers). `QUANTKIT_CPU_FLOAT32_LINEAR=off` turns the
AVX-512 BF16 case off (vLLM's kernel for every batch, no copy).

A second summation order (the study's numerics floor, `QUANTKIT_CPU_SUMMATION=split-k`): every half-precision
Linear computes in float32 as the sum of two half-K products, `F.linear(x[:, :K/2], w[:, :K/2]) + F.linear(x[:, K/2:],
w[:, K/2:])`, then rounds to the input dtype once. The products are the same exact float32 products and the
accumulation float32; only the order of the additions differs, as it does between two CPUs' kernels. It applies on
every ISA (AVX2, AVX-512, AMX) alike, so the floor it measures means the same on every machine. Its cost: every call
computes in float32, decoding included, reading twice the weight bytes (a coder's code suite ran ~3-4x a BF16 row).

The study's second order (`QUANTKIT_CPU_SUMMATION=permute-k`): every half-precision Linear takes its K input columns in
one fixed, seeded permutation (`k_permutation`, the same on every machine), the weight's columns permuted alike once
at load. Each call then runs on the kernel the default order would choose for it (vLLM's for small batches, the
float32 copy for large ones on this machine kind), on permuted operands: the same exact products, summed by the same
kernel in another order. It costs one gather of the input per call, so a BF16 row costs about what it does in the
default order. A tied embedding keeps its rows (only the LM head's copy is permuted: 2 bytes a parameter more).

The emulated GEMMs on decoded operands take the same order from `ordered_linear`, read once per layer at load, so
that the numerics stage measures a quantized row's own floor too (`eval.numerics: [bf16, w4a4_nvfp4]`): quantkit's
quantized Linears (`quantkit.serve.quant_method`, torch-emulation: float32 decoded weights times dequantized
activations), its routed experts (`quantkit.serve.moe_method`, each expert's two products) and the peers' emulation
kernels (`peer_kernels`: FP8-block in float32, NVFP4 in the activation dtype); a GLU hybrid's unquantized experts
(`quantkit.serve.hybrid.GLUExperts`) too, at their first call. Not reordered: vLLM's own kernels for layers it
serves itself (its unquantized fused MoE on CPUs, the GDN and attention kernels) and GatedNorm's rank-r gate_down
(a plain `nn.Linear` of the zoo's variants).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F

from quantkit.formats.experts import ExpertLinears

HALF_DTYPES = (torch.bfloat16, torch.float16)
FLOAT32_MIN_ROWS = 64  # rows (tokens) from which float32 beats oneDNN's bf16 kernel on Intel AVX-512 BF16 without AMX
SWITCH_ENV = "QUANTKIT_CPU_FLOAT32_LINEAR"  # "off": vLLM's kernel on AVX-512 BF16 CPUs; "on": float32 from 64 rows
GEMM_ENV = "QUANTKIT_CPU_FLOAT32_GEMM"  # "torch" / "onednn": the emulated rows' float32 GEMM (default: `float32_gemm`)
FLOAT32_GEMMS = ("torch", "onednn")
SUMMATION_ENV = "QUANTKIT_CPU_SUMMATION"  # "permute-k" / "split-k": a second summation order (the numerics floor)
SUMMATION_ORDERS = ("default", "permute-k", "split-k")
PERMUTATION_SEED = 0  # of `k_permutation`: fixed, so the second order is the same on every machine and run

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor string from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD", ...); "" where unreadable. Read
    once per process (every layer's load asks)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def amd_avx512_bf16() -> bool:
    """True on a CPU-only machine with an AMD CPU that has AVX-512 BF16 (Zen 4 / Zen 5 EPYC). Measured there
    (benchmarks/cpu_linear_rows.py, 2 cores): oneDNN's bf16 matmul 560-880 GFLOP/s from 16 rows, the float32 copy
    through PyTorch's `F.linear` (MKL, whose AMD path is AVX2) 100-190, oneDNN's float32 matmul 280-400. So there
    the half-precision Linears keep vLLM's oneDNN kernel and the emulated rows' float32 GEMMs take oneDNN's."""
    return not torch.cuda.is_available() and torch.cpu._is_avx512_bf16_supported() and cpu_vendor() == "AuthenticAMD"


def float32_gemm() -> str:
    """The kernel of the emulated rows' float32 GEMMs (`default_linear`): $QUANTKIT_CPU_FLOAT32_GEMM if set (one of
    FLOAT32_GEMMS), else "onednn" on AMD CPUs with AVX-512 BF16 (`amd_avx512_bf16`) where vLLM has its oneDNN ops,
    "torch" (`F.linear`) everywhere else."""
    chosen = os.environ.get(GEMM_ENV, "").strip().lower()
    if chosen:
        if chosen not in FLOAT32_GEMMS:
            raise ValueError(f"{GEMM_ENV}={chosen!r}: expected one of {', '.join(FLOAT32_GEMMS)}")
        return chosen
    if amd_avx512_bf16():
        from vllm import _custom_ops as ops

        if ops._supports_onednn:
            return "onednn"
    return "torch"


def default_linear(weight: torch.Tensor, gemm: str | None = None) -> Linear:
    """The default order's `cpu_linear(x, weight, bias)` for an emulated GEMM on the decoded weight `weight` (N, K):
    `F.linear`, or on a float32 CPU weight where `float32_gemm()` is "onednn" vLLM's oneDNN matmul on a copy of
    `weight` packed now (float32 inputs; `F.linear` for any other dtype). The same exact products and float32
    accumulation either way; only the summation order (the kernel's blocking) differs. Memory: oneDNN's packed copy
    (4 bytes a parameter) beside the decoded weight. `gemm` ("torch" / "onednn") overrides `float32_gemm()`."""
    if weight.dtype != torch.float32 or weight.is_cuda or (gemm or float32_gemm()) != "onednn":
        return F.linear
    from vllm import _custom_ops as ops

    handle = ops.create_onednn_mm(weight.detach().t(), 32)

    def linear(x: torch.Tensor, weight_: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != torch.float32:
            return F.linear(x, weight_, bias)
        return ops.onednn_mm(handle, x.contiguous(), None if bias is None else bias.float())

    linear.onednn = handle  # type: ignore[attr-defined]  # for inspection (tests)
    return linear


def cpu_kernels(amd_preference: bool = True) -> dict[str, str]:
    """What this process computes CPU Linears with in the default summation order, as recorded beside an evaluation
    (a cached row computed with other kernels is another summation order: a study does not mix the two).
    half_linear: "vllm" (its own kernel),
    "float32" (every call) or "float32>=64" (from that many rows); float32_gemm: `float32_gemm()`. With
    `amd_preference` False: what quantkit chose before AMD AVX-512 BF16 CPUs were told apart (2026-12-02), the
    configuration of an evaluation that records none."""
    if torch.cuda.is_available():
        return {"half_linear": "cuda", "float32_gemm": "cuda"}
    rows = _float32_min_rows(amd_preference)
    half = "vllm" if rows is None else "float32" if rows == 0 else f"float32>={rows}"
    return {"half_linear": half, "float32_gemm": float32_gemm() if amd_preference else "torch"}


def float32_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """A `layer.cpu_linear(x, weight, bias)` computing in float32 with copies of `weight` (N, K) and `bias` (N,)
    made now; its output has x's dtype. The `weight`/`bias` arguments it is called with are ignored."""
    weight32 = weight.detach().float().contiguous()
    bias32 = None if bias is None else bias.detach().float()

    def linear(x: torch.Tensor, _weight: torch.Tensor, _bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x.float(), weight32, bias32).to(x.dtype)

    # for inspection (benchmarks/ab_hybrid_cpu.py); attributes of a function, which mypy does not model
    linear.weight32, linear.bias32 = weight32, bias32  # type: ignore[attr-defined]
    return linear


def float32_split_k_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """`float32_linear` summed in another order: the two halves of K (the first K // 2 columns, then the rest) as
    two float32 products, added, then the bias; output in x's dtype (`ordered_linear`'s split-k, with float32
    copies of `weight` and `bias` made now)."""
    weight32 = weight.detach().float().contiguous()
    bias32 = None if bias is None else bias.detach().float()
    split_k = ordered_linear(weight32, "split-k")

    def linear(x: torch.Tensor, _weight: torch.Tensor, _bias: torch.Tensor | None) -> torch.Tensor:
        return split_k(x, weight32, bias32)

    linear.weight32, linear.bias32 = weight32, bias32  # type: ignore[attr-defined]
    return linear


def k_permutation(k: int) -> torch.Tensor:
    """The permute-k order's column order for an input width `k`: a permutation of range(k) (int64), drawn from
    torch's CPU generator seeded with PERMUTATION_SEED (the same on every machine and process)."""
    return torch.randperm(k, generator=torch.Generator().manual_seed(PERMUTATION_SEED))


def permuted_columns(linear: Linear, permutation: torch.Tensor, weight: torch.Tensor) -> Linear:
    """A `cpu_linear` computing `linear(x[..., permutation], weight, bias)`: `linear` built on `weight`, the layer's
    weight with its columns permuted alike (passed in place of the weight the layer is called with)."""

    def linear_permuted(x: torch.Tensor, _weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x.index_select(-1, permutation), weight, bias)

    linear_permuted.inner, linear_permuted.permutation = linear, permutation  # type: ignore[attr-defined]  # (tests)
    return linear_permuted


def ordered_linear(weight: torch.Tensor, order: str, gemm: str | None = None) -> Linear:
    """A `cpu_linear(x, weight, bias)` summed in `order` (one of SUMMATION_ORDERS), for the emulated GEMMs that
    compute on decoded operands: quantkit's quantized Linears and routed experts (float32 decoded weight `weight`
    (N, K), dequantized activations x (..., K), float32 bias (N,) or None) and the peers' NVFP4 emulation (both in
    the activation dtype). Output in x's dtype. default: `F.linear(x, weight, bias)` on the weight it is called
    with; permute-k: the same on the K columns in `k_permutation`'s order (`weight`'s columns permuted once now):
    the same kernel on permuted operands; split-k: the two halves of K as two float32 products, added, then the
    bias, rounded to x's dtype once (exact for float32 operands, as the half-precision Linears' split-k is for half
    ones). The second orders hold one more copy of the weight and ignore the weight they are called with: the same
    products summed in another order. default and permute-k run on `default_linear(weight, gemm)`'s kernel (a
    caller whose default order is F.linear whatever the CPU, the peers' kernels, passes gemm="torch")."""
    if order == "default":
        return default_linear(weight, gemm)
    k = weight.shape[1]
    if order == "permute-k":
        permutation = k_permutation(k)
        permuted = weight.index_select(1, permutation)
        return permuted_columns(default_linear(permuted, gemm), permutation, permuted)
    if order == "split-k":
        half = k // 2
        low, high = weight[:, :half].float().contiguous(), weight[:, half:].float().contiguous()

        def linear(x: torch.Tensor, _weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            x32 = x.float()
            out = F.linear(x32[..., :half], low) + F.linear(x32[..., half:], high)
            return (out if bias is None else out + bias.float()).to(x.dtype)

        return linear
    raise ValueError(f"summation order {order!r}: expected one of {', '.join(SUMMATION_ORDERS)}")


def ordered_expert_linears(gate_up: torch.Tensor, down: torch.Tensor, order: str) -> ExpertLinears | None:
    """The routed experts' products in `order` (`quantkit.formats.experts.routed_experts_forward`'s `linears`): per
    expert e, `ordered_linear(gate_up[e], order)` and `ordered_linear(down[e], order)` for stacks gate_up (E, 2I, H)
    and down (E, H, I); None in the default order where that is F.linear (F.linear on the stacks, no copy)."""
    if order == "default" and (gate_up.dtype != torch.float32 or float32_gemm() != "onednn"):
        return None
    return [ordered_linear(w, order) for w in gate_up], [ordered_linear(w, order) for w in down]


def summation_order() -> str:
    """The summation order this process computes half-precision CPU Linears in: $QUANTKIT_CPU_SUMMATION, one of
    SUMMATION_ORDERS (unset: "default"); ValueError naming the choices for anything else."""
    order = os.environ.get(SUMMATION_ENV, "").strip().lower() or "default"
    if order not in SUMMATION_ORDERS:
        raise ValueError(f"{SUMMATION_ENV}={order!r}: expected one of {', '.join(SUMMATION_ORDERS)}")
    return order


def split_by_rows(small: Linear, large: Linear, min_rows: int) -> Linear:
    """A `cpu_linear` calling `large` for inputs (..., K) of at least `min_rows` rows, else `small`."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        return (large if rows >= min_rows else small)(x, weight, bias)

    linear.small, linear.large = small, large  # type: ignore[attr-defined]  # for inspection (tests)
    return linear


def _is_half_linear(weight: torch.Tensor) -> bool:
    return not weight.is_meta and weight.ndim == 2 and weight.numel() > 0 and weight.dtype in HALF_DTYPES


def cpu_lacks_bf16_matmul() -> bool:
    """True on a CPU-only machine whose CPU has neither AVX-512 BF16 nor Arm BF16: where vLLM's CPU backend takes its
    slow bf16 fallbacks (this module's Linears, `gdn_cpu`'s Gated DeltaNet prefill)."""
    if torch.cuda.is_available():
        return False
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import is_arm_bf16

    return not (torch.cpu._is_avx512_bf16_supported() or is_arm_bf16())


def float32_min_rows() -> int | None:
    """Rows from which this machine computes half-precision Linears in float32: 0 (always) where the CPU lacks a
    bf16 matmul; `FLOAT32_MIN_ROWS` on Intel AVX-512 BF16 CPUs without AMX (`QUANTKIT_CPU_FLOAT32_LINEAR=off`:
    never); None (never) on AMD AVX-512 BF16 CPUs, whose oneDNN bf16 matmul is 4-6x the float32 one
    (`amd_avx512_bf16`; `QUANTKIT_CPU_FLOAT32_LINEAR=on`: from FLOAT32_MIN_ROWS), on GPUs, AMX and Arm CPUs, whose
    bf16 matmuls were not measured slower. With the split-k summation order (`summation_order`) 0 on every CPU."""
    if not torch.cuda.is_available() and summation_order() == "split-k":
        return 0
    return _float32_min_rows(True)


def _float32_min_rows(amd_preference: bool) -> int | None:
    """`float32_min_rows` in the default summation order; with `amd_preference` False, what it was before AMD
    AVX-512 BF16 CPUs were told apart."""
    if cpu_lacks_bf16_matmul():
        return 0
    if torch.cuda.is_available() or not torch.cpu._is_avx512_bf16_supported():
        return None
    switch = os.environ.get(SWITCH_ENV, "").lower()
    if torch.cpu._is_amx_tile_supported() or switch in ("off", "0", "false"):
        return None
    if amd_preference and amd_avx512_bf16() and switch not in ("on", "1", "true"):
        return None
    return FLOAT32_MIN_ROWS


def vllm_dispatch() -> Callable[[torch.nn.Module, bool], None]:
    """vLLM's own CPU unquantized GEMM dispatch, whether or not `install` has wrapped it in this process."""
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm
    return getattr(dispatch, "wrapped", dispatch)


def _attach(
    layer: torch.nn.Module,
    dispatch: Callable[[torch.nn.Module, bool], None],
    remove_weight: bool,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    min_rows: int | None,
) -> None:
    """The default order's kernels for a half-precision `layer` whose weight is `weight`: vLLM's `dispatch`, then
    the float32 copy from `min_rows` rows (for every call with 0 where vLLM kept the plain weight; never with None)."""
    dispatch(layer, remove_weight)
    if min_rows is None:
        return
    if min_rows > 0:  # vLLM's kernel for small batches, a float32 copy for large ones
        vllm_linear = cast(Linear, layer.cpu_linear)
        # nn.Module.__setattr__ takes any value; torch's stub admits only tensors and modules
        layer.cpu_linear = split_by_rows(vllm_linear, float32_linear(weight, bias), min_rows)  # type: ignore[assignment]
        return
    if not _is_half_linear(cast(torch.Tensor, layer.weight)):
        return  # another path (oneDNN, sgl, zentorch) took the layer and dropped or repacked its weight
    layer.cpu_linear = float32_linear(weight, bias)  # type: ignore[assignment]
    if remove_weight:  # as vLLM's oneDNN path does: the layer computes from its own copy only
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)


def install() -> bool:
    """Wrap vLLM's CPU unquantized GEMM dispatch (idempotent; nothing on a GPU machine) so that each layer it
    dispatches computes as `float32_min_rows` and `summation_order` say at that moment (read per layer, so one
    process can open engines under either order); True when the float32 path is in use now."""
    if torch.cuda.is_available():
        return False
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "quantkit_float32", False):
        return float32_min_rows() is not None

    def dispatch_float32(layer: torch.nn.Module, remove_weight: bool) -> None:
        # read before dispatch: on BF16 CPUs it repacks (E, 1, 4) conv weights into 2-D, and may drop the weight
        weight = cast(torch.Tensor, layer.weight)
        bias = getattr(layer, "bias", None)
        half_linear = _is_half_linear(weight)
        min_rows = float32_min_rows()
        order = summation_order()
        if not half_linear or (min_rows is None and order == "default"):
            dispatch(layer, remove_weight)
            return
        if order == "split-k":  # whatever kernel vLLM chose (oneDNN may have repacked the weight)
            dispatch(layer, remove_weight)
            layer.cpu_linear = float32_split_k_linear(weight, bias)  # type: ignore[assignment]
            if remove_weight:
                layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
            return
        if order == "permute-k":  # the default order's kernels, built on the permuted columns
            permutation = k_permutation(weight.shape[1])
            permuted = weight.detach().index_select(1, permutation)
            layer.weight = torch.nn.Parameter(permuted, requires_grad=False)
            _attach(layer, dispatch, remove_weight, permuted, bias, min_rows)
            layer.cpu_linear = permuted_columns(cast(Linear, layer.cpu_linear), permutation, permuted)  # type: ignore[assignment]
            if not remove_weight:  # a tied embedding looks its rows up in the weight: give it back unpermuted
                layer.weight = weight
            return
        _attach(layer, dispatch, remove_weight, weight, bias, min_rows)

    dispatch_float32.quantkit_float32 = True  # type: ignore[attr-defined]  # a function attribute (the install mark)
    dispatch_float32.wrapped = dispatch  # type: ignore[attr-defined]  # vLLM's own (`vllm_dispatch`)
    utils.dispatch_cpu_unquantized_gemm = dispatch_float32
    return float32_min_rows() is not None
