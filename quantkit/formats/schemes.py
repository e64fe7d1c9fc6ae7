"""The quantization schemes, one registry: each scheme owns its checkpoint contract and its numerics.

`SCHEMES[name]` is a small frozen object; the checkpoint writer (`quantkit.quantize.checkpoint`), the checker
(`quantkit.serve.checkpoint_check`), the fake-quant reference (`quantkit.quantize.fake_quant`), vLLM's quant
method (`quantkit.serve.quant_method`) and the kernels' dispatch (`quantkit.kernels.schemes`) ask it instead of
branching on scheme names. Adding a scheme = one `Scheme` subclass, its instance in `SCHEMES` (plus its
kernels' entry for CUDA) and its tests.

Checkpoint tensors of a quantized Linear `<name>` with weight (N, K) (docs/checkpoint-format.md):

    fp8_block  <name>.weight                float8_e4m3fn (N, K)
               <name>.weight_scale          float32 (ceil(N/128), ceil(K/128))  decode scale per 128x128 block
    nvfp4      <name>.weight_packed         uint8 (N, K_pad/2)                  E2M1 codes, low nibble first
               <name>.weight_scale          float8_e4m3fn (N, K_pad/16)         decode scale per group of 16
               <name>.weight_global_scale   float32 (1,)                        per-tensor decode scale
               <name>.input_global_scale    float32 (1,)   static activation scale only (decode, amax / 2688)
    nvfp4_four_over_six                     nvfp4's tensors; activations per token with Four Over Six scales

All scales are DECODE scales (value = code * scale), unlike compressed-tensors' `*_global_scale` (encode,
the reciprocal). Activations are quantized at run time: FP8 per token; NVFP4 per token (the paper's) or
with the static `input_global_scale`. Under tensor parallelism a layer may hold a slice of K; `row_amax`
(..., 1) then gives each whole row's max |x| so that per-token scales equal the unsharded model's.

bf16 is no scheme: the recipe scheme name `UNQUANTIZED` ("bf16") means the checkpoint keeps every Linear,
cast to bfloat16, with no quantization_config; `scheme_for(UNQUANTIZED)` is None.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from quantkit.checkpoints import CheckpointError
from quantkit.formats import fp8
from quantkit.formats.constants import F8E4M3_DTYPE, FP8_WEIGHT_BLOCK, NVFP4_GROUP, ActivationScale, WeightScales
from quantkit.formats.experts import EXPERT_MATRIX
from quantkit.formats.nvfp4 import (
    NVFP4Tensor,
    dequantize_nvfp4,
    fake_quant_nvfp4_activation,
    fake_quant_nvfp4_four_over_six,
    fake_quant_nvfp4_weight,
    nvfp4_global_scale,
    quantize_nvfp4_activation,
    quantize_nvfp4_activation_four_over_six,
    quantize_nvfp4_weight,
    quantize_nvfp4_weight_four_over_six,
)
from quantkit.formats.scale_search import quantize_fp8_block_mse, quantize_nvfp4_weight_mse

FORMAT_VERSION = 1  # quantization_config.format_version of the checkpoints written here
UNQUANTIZED = "bf16"  # the recipe scheme that quantizes nothing


@dataclass(frozen=True)
class LayerTensor:
    """A parameter of a served layer of n output rows (all fused shards of one TP rank) and k input columns.

    rows_per_entry: output rows one checkpoint row covers (block scales are repeated to one row per output
    row at load, so that fused shards need not start on a block boundary). per_shard: None for a row-wise
    tensor sliced like the weight; "rows" for one number per checkpoint module repeated over its rows;
    "one" for one entry per fused shard.
    """

    suffix: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    rows_per_entry: int = 1
    per_shard: str | None = None


@dataclass(frozen=True, eq=False)  # one instance a scheme: compared and hashed by identity
class Scheme(ABC):
    """A scheme's contract. name: its `quantization_config.scheme`; tensors: the checkpoint tensors of a
    quantized Linear, suffix -> safetensors dtype, in the order the GEMM takes them; marker: the suffix only a
    module quantized with this scheme stores; k_multiple: the K granule of the scales (a tensor-parallel
    shard of K must be a multiple of it); activation_scales: the activation modes it supports;
    static_tensors: the extra tensors of the static activation mode; precision: the paper's label (W8A8, W4A4);
    weight_scales: the weight decode-scale rules it can encode (`WeightScales`); weight_grid: the grid of its
    weights (schemes that differ only in their activations share one); weight_block: the (rows, columns) of the
    weight that one decode scale covers."""

    name: str
    tensors: Mapping[str, str]
    marker: str
    k_multiple: int
    activation_scales: tuple[str, ...] = (ActivationScale.PER_TOKEN,)
    static_tensors: Mapping[str, str] = field(default_factory=dict)
    precision: str = ""
    weight_scales: tuple[str, ...] = (WeightScales.MINMAX, WeightScales.MSE)
    weight_grid: str = ""  # the weight grid GPTQ rounds on (`quantkit.quantize.gptq`): "fp8_block" | "nvfp4"
    weight_block: tuple[int, int] = (1, 1)  # (rows, columns) of the weight one decode scale covers
    method: str = ""  # the method its activation rule is named after in a row label ("4/6"), "" for none

    # ------------------------------------------------------------------ checkpoint contract

    def activation_scale(self, requested: str | None) -> str | None:
        """The activation_scale a checkpoint records: the recipe's where the scheme has a choice, else its only one."""
        return requested if len(self.activation_scales) > 1 else self.activation_scales[0]

    @abstractmethod
    def config_keys(self) -> dict[str, Any]:
        """The scheme's own quantization_config keys besides scheme and activation_scale."""

    def quantization_config(self, activation_scale: str | None) -> dict[str, Any]:
        """format_version, scheme, the scheme's keys and activation_scale of a quantization_config."""
        return {
            "format_version": FORMAT_VERSION,
            "scheme": self.name,
            **self.config_keys(),
            "activation_scale": self.activation_scale(activation_scale),
        }

    def checkpoint_tensors(self, activation_scale: str) -> dict[str, str]:
        """suffix -> safetensors dtype of every tensor a quantized Linear stores in this activation mode."""
        return {**self.tensors, **(self.static_tensors if activation_scale == ActivationScale.STATIC else {})}

    @abstractmethod
    def shape_problem(self, module: str, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
        """What is wrong with the shapes (suffix -> shape) of `module`'s tensors, or None."""

    # ------------------------------------------------------------------ numerics

    @abstractmethod
    def encode(
        self,
        weight: torch.Tensor,
        name: str,
        weight_scales: str = WeightScales.MINMAX,
        scales: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Weight (N, K) -> {tensor suffix: tensor} for the checkpoint (`name` labels errors); `weight_scales`: how
        the decode scales are chosen (`WeightScales`: min-max, or searched, `quantkit.formats.scale_search`);
        `scales`: decode scales already chosen (GPTQ's), under their tensor suffixes, used as given."""

    @abstractmethod
    def decode(self, tensors: Mapping[str, torch.Tensor], in_features: int) -> torch.Tensor:
        """Checkpoint tensors of one Linear -> float32 weight (N, K)."""

    @abstractmethod
    def stored_bits(self, n: int, k: int) -> int:
        """Bits the checkpoint stores for an (n, k) weight in this scheme: its codes and every decode scale (what
        `encode` writes; static activation tensors not counted)."""

    def fake_quant_weight(self, weight: torch.Tensor, name: str) -> torch.Tensor:
        """decode(encode(weight)) with min-max scales: weight (N, K) -> float32 (N, K) as served."""
        return self.decode(self.encode(weight, name), weight.shape[1])

    def static_activation_tensors(self, amax: torch.Tensor) -> dict[str, torch.Tensor]:
        """Calibrated max |x| of a Linear's input, shape (1,) -> its static activation tensors."""
        raise ValueError(f"scheme {self.name} has no static activation scale")

    @abstractmethod
    def quantize_activation(
        self, x: torch.Tensor, input_global_scale: torch.Tensor | None = None, row_amax: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Activations (..., K) -> the activation operands of the scheme's GEMM, as its kernel quantizer
        writes them (see the subclasses)."""

    @abstractmethod
    def fake_quant_activation(
        self, x: torch.Tensor, input_global_scale: torch.Tensor | None = None, row_amax: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Quantize-dequantize activations (..., K) as the scheme does at run time; float32 result."""

    # ------------------------------------------------------------------ served (vLLM) layer layout

    @abstractmethod
    def layer_tensors(self, n: int, k: int, shards: int, activation_scale: str) -> list[LayerTensor]:
        """The parameters of a served layer of n output rows (`shards` fused checkpoint modules) and k inputs."""

    @abstractmethod
    def decode_layer(self, params: Mapping[str, torch.Tensor], k: int) -> torch.Tensor:
        """A served layer's weight parameters (`tensors` suffixes, `layer_tensors` layout) -> float32 (n, k)."""


class FP8BlockScheme(Scheme):
    """FP8 E4M3 W8A8 (`quantkit.formats.fp8`): 128x128 block-scaled weights, per-token activations."""

    def config_keys(self) -> dict[str, Any]:
        """weight_block_size [128, 128], group_size None."""
        return {"weight_block_size": [FP8_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK], "group_size": None}

    def shape_problem(self, module: str, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
        """weight_scale must be (ceil(N/128), ceil(K/128)) for the (N, K) weight; else the mismatch."""
        n, k = shapes["weight"]
        want = (-(-n // FP8_WEIGHT_BLOCK), -(-k // FP8_WEIGHT_BLOCK))
        if shapes["weight_scale"] != want:
            return (
                f"{module}.weight_scale has shape {shapes['weight_scale']}, "
                f"a ({n}, {k}) weight in {FP8_WEIGHT_BLOCK}x{FP8_WEIGHT_BLOCK} blocks needs {want}"
            )
        return None

    def encode(
        self,
        weight: torch.Tensor,
        name: str,
        weight_scales: str = WeightScales.MINMAX,
        scales: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Weight (N, K) -> weight float8_e4m3fn (N, K) and weight_scale float32 (ceil(N/128), ceil(K/128)), the decode
        scale of each 128x128 block (given in `scales`, else min-max or searched: `weight_scales`)."""
        if scales is not None:
            q, scale = fp8.quantize_fp8_block(weight, name=name, scale=scales["weight_scale"])
        else:
            quantize = quantize_fp8_block_mse if weight_scales == WeightScales.MSE else fp8.quantize_fp8_block
            q, scale = quantize(weight, name=name)
        return {"weight": q, "weight_scale": scale}

    def decode(self, tensors: Mapping[str, torch.Tensor], in_features: int) -> torch.Tensor:
        """weight * its 128x128 block's decode scale -> float32 (N, K); `in_features` unused (K is stored unpadded)."""
        return fp8.dequantize_fp8_block(tensors["weight"], tensors["weight_scale"])

    def stored_bits(self, n: int, k: int) -> int:
        """8 bits a weight, 32 a 128x128 block's scale."""
        return 8 * n * k + 32 * -(-n // FP8_WEIGHT_BLOCK) * -(-k // FP8_WEIGHT_BLOCK)

    def quantize_activation(
        self, x: torch.Tensor, input_global_scale: torch.Tensor | None = None, row_amax: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """(q float8_e4m3fn (..., K), per-token decode scale float32 (..., 1)); no static mode."""
        return fp8.quantize_fp8_per_token(x, row_amax=row_amax)

    def fake_quant_activation(
        self, x: torch.Tensor, input_global_scale: torch.Tensor | None = None, row_amax: torch.Tensor | None = None
    ) -> torch.Tensor:
        """FP8 E4M3 quantize-dequantize per token (`row_amax`: the whole row's under TP), (..., K) -> float32 (..., K);
        no static mode (`input_global_scale` unused)."""
        return fp8.dequantize_fp8_per_token(*self.quantize_activation(x, input_global_scale, row_amax))

    def layer_tensors(self, n: int, k: int, shards: int, activation_scale: str) -> list[LayerTensor]:
        """weight (n, k) E4M3; weight_scale (n, ceil(k/128)) float32, each block row repeated over its rows."""
        return [
            LayerTensor("weight", (n, k), F8E4M3_DTYPE),
            LayerTensor("weight_scale", (n, -(-k // FP8_WEIGHT_BLOCK)), torch.float32, rows_per_entry=FP8_WEIGHT_BLOCK),
        ]

    def decode_layer(self, params: Mapping[str, torch.Tensor], k: int) -> torch.Tensor:
        """weight (n, k) E4M3 times weight_scale (n, ceil(k/128)), each entry over its 128 columns -> float32 (n, k)."""
        weight = params["weight"]
        scale = fp8.expand_block_scales(params["weight_scale"], (1, FP8_WEIGHT_BLOCK), tuple(weight.shape))
        return weight.float() * scale


FP8_BLOCK = FP8BlockScheme(
    "fp8_block",
    {"weight": "F8_E4M3", "weight_scale": "F32"},
    marker="weight_scale",
    k_multiple=FP8_WEIGHT_BLOCK,
    precision="W8A8",
    weight_grid="fp8_block",
    weight_block=(FP8_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK),
)


class NVFP4Scheme(Scheme):
    """NVFP4 W4A4 (`quantkit.formats.nvfp4`): E2M1 in groups of 16, E4M3 group scales, FP32 second stage
    (per tensor for weights; per token, or the static calibrated `input_global_scale`, for activations)."""

    def config_keys(self) -> dict[str, Any]:
        """weight_block_size None, group_size 16."""
        return {"weight_block_size": None, "group_size": NVFP4_GROUP}

    def shape_problem(self, module: str, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
        """No unquantized `weight` beside weight_packed (N, K_pad/2); weight_scale (N, K_pad/16); else what differs."""
        if "weight" in shapes:
            return f"nvfp4 module {module} also stores an unquantized {module}.weight"
        n, half_k = shapes["weight_packed"]
        want = (n, half_k * 2 // NVFP4_GROUP)
        if half_k * 2 % NVFP4_GROUP or shapes["weight_scale"] != want:
            return (
                f"{module}.weight_scale has shape {shapes['weight_scale']}, "
                f"packed weight {(n, half_k)} needs {want} (one scale per {NVFP4_GROUP} elements)"
            )
        return None

    def encode(
        self,
        weight: torch.Tensor,
        name: str,
        weight_scales: str = WeightScales.MINMAX,
        scales: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Weight (N, K) -> weight_packed uint8 (N, K_pad/2), weight_scale float8_e4m3fn (N, K_pad/16) and
        weight_global_scale float32 (1,) decode scales (given in `scales`, else min-max or searched:
        `weight_scales`; the global one per tensor, amax / 2688)."""
        if scales is not None:
            t = quantize_nvfp4_weight(
                weight, name=name, block_scale=scales["weight_scale"], global_scale=scales["weight_global_scale"]
            )
        else:
            quantize = {
                WeightScales.MINMAX: quantize_nvfp4_weight,
                WeightScales.MSE: quantize_nvfp4_weight_mse,
                WeightScales.FOUR_OVER_SIX: quantize_nvfp4_weight_four_over_six,
            }[WeightScales(weight_scales)]
            t = quantize(weight, name=name)
        return {
            "weight_packed": t.packed,
            "weight_scale": t.block_scale,
            "weight_global_scale": t.global_scale.reshape(1),
        }

    def decode(self, tensors: Mapping[str, torch.Tensor], in_features: int) -> torch.Tensor:
        """Checkpoint tensors of one Linear -> float32 weight (N, in_features), the K padding cropped."""
        return dequantize_nvfp4(
            NVFP4Tensor(
                tensors["weight_packed"],
                tensors["weight_scale"],
                tensors["weight_global_scale"].reshape(()),
                in_features,
            )
        )

    def stored_bits(self, n: int, k: int) -> int:
        """4 bits a weight (K padded to groups of 16), 8 a group's E4M3 scale, 32 the tensor's global scale."""
        k_pad = -(-k // NVFP4_GROUP) * NVFP4_GROUP
        return 4 * n * k_pad + 8 * n * (k_pad // NVFP4_GROUP) + 32

    def fake_quant_weight(self, weight: torch.Tensor, name: str) -> torch.Tensor:
        """decode(encode(weight)) with min-max scales, equal bit for bit, without the packing round trip."""
        return fake_quant_nvfp4_weight(weight, name=name)

    def static_activation_tensors(self, amax: torch.Tensor) -> dict[str, torch.Tensor]:
        """input_global_scale: float32 (1,) decode scale amax / 2688 (1.0 where amax is 0)."""
        return {"input_global_scale": nvfp4_global_scale(amax).float()}

    def _activation(
        self, x: torch.Tensor, input_global_scale: torch.Tensor | None, row_amax: torch.Tensor | None
    ) -> NVFP4Tensor:
        if input_global_scale is None:
            return quantize_nvfp4_activation(x, ActivationScale.PER_TOKEN, row_amax=row_amax)
        return quantize_nvfp4_activation(x, ActivationScale.STATIC, input_global_scale.reshape(()))

    def quantize_activation(
        self, x: torch.Tensor, input_global_scale: torch.Tensor | None = None, row_amax: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """(packed uint8 (..., K_pad/2), block scales float8_e4m3fn (..., K_pad/16), global decode scale
        float32: (..., 1) per token, () static)."""
        t = self._activation(x, input_global_scale, row_amax)
        return t.packed, t.block_scale, t.global_scale

    def fake_quant_activation(
        self, x: torch.Tensor, input_global_scale: torch.Tensor | None = None, row_amax: torch.Tensor | None = None
    ) -> torch.Tensor:
        """NVFP4 quantize-dequantize, (..., K) -> float32 (..., K): per token (`row_amax` under TP), or static with
        `input_global_scale`."""
        if input_global_scale is None:
            return fake_quant_nvfp4_activation(x, ActivationScale.PER_TOKEN, row_amax=row_amax)
        return fake_quant_nvfp4_activation(x, ActivationScale.STATIC, input_global_scale.reshape(()))

    def layer_tensors(self, n: int, k: int, shards: int, activation_scale: str) -> list[LayerTensor]:
        """weight_packed (n, K_pad/2) uint8; weight_scale (n, K_pad/16) E4M3; weight_global_scale (n,) float32,
        each shard's per-tensor scale repeated over its rows; static: input_global_scale (shards,) float32."""
        groups = -(-k // NVFP4_GROUP)
        tensors = [
            LayerTensor("weight_packed", (n, groups * NVFP4_GROUP // 2), torch.uint8),
            LayerTensor("weight_scale", (n, groups), F8E4M3_DTYPE),
            LayerTensor("weight_global_scale", (n,), torch.float32, per_shard="rows"),
        ]
        if activation_scale == ActivationScale.STATIC:
            tensors.append(LayerTensor("input_global_scale", (shards,), torch.float32, per_shard="one"))
        return tensors

    def decode_layer(self, params: Mapping[str, torch.Tensor], k: int) -> torch.Tensor:
        """weight_packed, weight_scale and per-row weight_global_scale (n,) -> float32 (n, k), the K padding cropped."""
        return dequantize_nvfp4(
            NVFP4Tensor(params["weight_packed"], params["weight_scale"], params["weight_global_scale"][:, None], k)
        )


NVFP4 = NVFP4Scheme(
    "nvfp4",
    {"weight_packed": "U8", "weight_scale": "F8_E4M3", "weight_global_scale": "F32"},
    marker="weight_packed",
    k_multiple=NVFP4_GROUP,
    activation_scales=(ActivationScale.PER_TOKEN, ActivationScale.STATIC),
    static_tensors={"input_global_scale": "F32"},
    precision="W4A4",
    weight_scales=(WeightScales.MINMAX, WeightScales.MSE, WeightScales.FOUR_OVER_SIX),
    weight_grid="nvfp4",
    weight_block=(1, NVFP4_GROUP),
)


class NVFP4FourOverSixScheme(NVFP4Scheme):
    """NVFP4 W4A4 with Four Over Six activations (Cook et al. 2025, arXiv 2512.02010): per token, each group of 16
    encoded with its max to 6 or to 4, the smaller squared error kept, on a decode scale of row_amax / 1536
    (`quantkit.formats.nvfp4.quantize_nvfp4_activation_four_over_six`). The checkpoint tensors, the weight grid and
    the GEMM are NVFP4's; the recipe chooses the weights' scales (`weight_scales: four_over_six` for 4/6 weights
    too). Per token only: no static activation scale."""

    def static_activation_tensors(self, amax: torch.Tensor) -> dict[str, torch.Tensor]:
        raise ValueError(f"scheme {self.name} has no static activation scale (its activations are per token)")

    def _activation(
        self, x: torch.Tensor, input_global_scale: torch.Tensor | None, row_amax: torch.Tensor | None
    ) -> NVFP4Tensor:
        if input_global_scale is not None:
            raise ValueError(f"scheme {self.name} has no static activation scale (its activations are per token)")
        return quantize_nvfp4_activation_four_over_six(x, row_amax=row_amax)

    def fake_quant_activation(
        self, x: torch.Tensor, input_global_scale: torch.Tensor | None = None, row_amax: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Four Over Six quantize-dequantize per token (`row_amax` under TP), (..., K) -> float32 (..., K)."""
        if input_global_scale is not None:
            raise ValueError(f"scheme {self.name} has no static activation scale (its activations are per token)")
        return fake_quant_nvfp4_four_over_six(x, row_amax=row_amax)


NVFP4_FOUR_OVER_SIX = NVFP4FourOverSixScheme(
    "nvfp4_four_over_six",
    dict(NVFP4.tensors),
    marker="weight_packed",
    k_multiple=NVFP4_GROUP,
    precision="W4A4",
    method="4/6",
    weight_scales=(WeightScales.MINMAX, WeightScales.MSE, WeightScales.FOUR_OVER_SIX),
    weight_grid="nvfp4",
    weight_block=(1, NVFP4_GROUP),
)

SCHEMES: dict[str, Scheme] = {s.name: s for s in (FP8_BLOCK, NVFP4, NVFP4_FOUR_OVER_SIX)}


def get_scheme(name: str) -> Scheme:
    """The registered scheme `name`; ValueError listing the known ones."""
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; expected one of {list(SCHEMES)}")
    return SCHEMES[name]


def scheme_for(name: str) -> Scheme | None:
    """A recipe's scheme: None for `UNQUANTIZED` (bf16), else `get_scheme(name)`."""
    return None if name == UNQUANTIZED else get_scheme(name)


def checkpoint_suffixes() -> tuple[str, ...]:
    """Every tensor suffix any scheme stores for a quantized Linear (static activation tensors included)."""
    suffixes = {s for scheme in SCHEMES.values() for s in (*scheme.tensors, *scheme.static_tensors)}
    return tuple(sorted(suffixes))


def scheme_from_config(qc: dict, where: str = "quantization_config") -> Scheme:
    """Check the keys of a quantkit quantization_config (docs/checkpoint-format.md), without the tensors, and
    return its scheme; CheckpointError names the bad key."""
    if qc.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: format_version {qc.get('format_version')!r} is not supported "
            f"(expected {FORMAT_VERSION}; re-run `quantkit quantize`)"
        )
    name = qc.get("scheme")
    if name not in SCHEMES:
        raise CheckpointError(f"{where}: scheme {name!r} is not one of {list(SCHEMES)}")
    scheme = SCHEMES[name]
    activation_scale = qc.get("activation_scale")
    if activation_scale not in scheme.activation_scales:
        raise CheckpointError(f"{where}: activation_scale {activation_scale!r} is not valid for scheme {name}")
    if not qc.get("quantized_modules"):
        raise CheckpointError(f"{where}: quantized_modules is empty")
    overrides = qc.get("module_schemes") or {}
    if bad := {m: s for m, s in overrides.items() if s not in SCHEMES}:
        raise CheckpointError(f"{where}: module_schemes {bad} name schemes not in {list(SCHEMES)}")
    if unlisted := sorted(set(overrides) - set(qc["quantized_modules"])):
        raise CheckpointError(f"{where}: module_schemes names {unlisted[:3]}, which are not quantized_modules")
    online = online_hadamard_blocks(qc)
    if unlisted := sorted(set(online) - set(qc["quantized_modules"])):
        raise CheckpointError(
            f"{where}: rotation.online_hadamard names {unlisted[:3]}, which are not quantized_modules"
        )
    if bad := {m: b for m, b in online.items() if not isinstance(b, int) or b <= 0 or b & (b - 1)}:
        raise CheckpointError(f"{where}: rotation.online_hadamard blocks {bad} are not powers of two")
    rotated_experts = {match["experts"] for m in online if (match := EXPERT_MATRIX.match(m))}
    for experts in sorted(rotated_experts):
        downs = [
            m
            for m in qc["quantized_modules"]
            if (match := EXPERT_MATRIX.match(m)) and match["experts"] == experts and match["proj"] == "down_proj"
        ]
        if missing := [m for m in downs if m not in online]:
            raise CheckpointError(
                f"{where}: rotation.online_hadamard names some of {experts}'s down_proj but not {missing[0]} "
                "(a fused experts module transforms every expert's down_proj input or none)"
            )
        experts_online_block(online, experts)
    return scheme


def online_hadamard_blocks(qc: dict) -> dict[str, int]:
    """{module: block} of a quantization_config's rotation (`quantkit.quantize.rotation`): the modules whose input
    is transformed by `quantkit.formats.hadamard.block_hadamard` before it is quantized; {} without rotation."""
    return dict((qc.get("rotation") or {}).get("online_hadamard") or {})


def experts_online_block(online: Mapping[str, int], experts: str) -> int | None:
    """The online Hadamard block of the routed experts module `experts` (`online_hadamard_blocks`: one entry per
    expert's down_proj, `<experts>.<e>.down_proj`, all one block), None when they have none; CheckpointError when
    its experts' blocks differ (one fused module, one transform)."""
    blocks = {b for m, b in online.items() if (match := EXPERT_MATRIX.match(m)) and match["experts"] == experts}
    if len(blocks) > 1:
        raise CheckpointError(f"rotation.online_hadamard gives {experts}'s experts different blocks {sorted(blocks)}")
    return blocks.pop() if blocks else None


def module_scheme(qc: dict, module: str) -> tuple[Scheme, str]:
    """The scheme of the quantized `module` in a checked quantization_config (`scheme_from_config`) and its
    activation scale: its `module_schemes` entry (mixed precision by module), else `scheme`; the activation scale is
    the config's where that scheme offers a choice, else the scheme's only one (FP8: per token)."""
    scheme = SCHEMES[(qc.get("module_schemes") or {}).get(module, qc["scheme"])]
    requested = qc["activation_scale"]
    return scheme, requested if requested in scheme.activation_scales else scheme.activation_scales[0]
