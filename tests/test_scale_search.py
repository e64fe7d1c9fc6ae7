"""Searched weight scales (`quantkit.formats.scale_search`, recipe key `weight_scales: mse`, issue 31 item 1).

What is asserted and why it cannot fail by chance:
- Never worse than min-max, block by block: the candidate set starts with the min-max scale and a later candidate
  replaces the best only when its error is strictly smaller, so the chosen error is <= the min-max error as the
  search computed them (float32 sums). The test recomputes both errors in float64 from the decoded weights; a
  float32 sum of n non-negative terms is within n u (u = 2**-24) relative of the exact sum, so the float64
  errors obey chosen <= minmax * (1 + 2 n u) (n = 128 * 128 FP8 block elements, 16 NVFP4 group elements).
- The search finds the minimum over its candidates: a plain per-block loop (the reference: Python loops over
  blocks and candidates, float64 errors) gives each block's least error; the vectorized choice's float64 error is
  within the same 2 n u of it (ties between candidates may pick either: only the error is compared).
- It helps where clipping should: heavy-tailed weights (a Gaussian scale mixture) lose >= 5% of their
  NVFP4 squared error (measured 20% on SmolLM2-135M's q_proj and down_proj, 14% here, 2026-11-26; a min-max scale
  spends E2M1's 8 levels on the tail, the search cannot do worse by construction, and for this data it is
  the expected behaviour of every MSE observer), and the checkpoint written with the recipe stores the scales
  the format functions give (bit for bit) and records `weight_scales: mse`.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from quantkit.formats.constants import FP8_WEIGHT_BLOCK, NVFP4_GROUP, WeightScales
from quantkit.formats.fp8 import fp8_scale_from_amax, quantize_fp8_block, to_blocks, to_e4m3
from quantkit.formats.nvfp4 import (
    e2m1_to_float,
    nvfp4_block_scales,
    nvfp4_global_scale,
    nvfp4_groups,
    round_to_e2m1,
)
from quantkit.formats.scale_search import (
    FP8_CLIP_GRID,
    NVFP4_SCALE_CODE_STEPS,
    fp8_block_scales_mse,
    nvfp4_block_scales_mse,
)
from quantkit.formats.schemes import SCHEMES

U = 2.0**-24


def heavy_tailed(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """(n, k) float32 weights with heavy tails: a Gaussian over the square root of a uniform (a scale mixture)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) / torch.rand(n, k, generator=gen).clamp_min(0.05).sqrt() * 0.02


def block_errors(scheme: str, w: torch.Tensor, weight_scales: str) -> torch.Tensor:
    """float64 squared error per FP8 block (nb, kb) or NVFP4 group (N, G) of the encoded-decoded weight."""
    s = SCHEMES[scheme]
    diff = (s.decode(s.encode(w, "w", weight_scales), w.shape[1]).double() - w.double()).pow(2)
    if scheme == "fp8_block":
        return to_blocks(diff, FP8_WEIGHT_BLOCK).sum(dim=(-2, -1))
    return nvfp4_groups(diff).double().sum(-1)


@pytest.mark.parametrize("scheme,n", [("fp8_block", FP8_WEIGHT_BLOCK**2), ("nvfp4", NVFP4_GROUP)])
def test_searched_scales_are_never_worse_than_min_max(scheme, n):
    w = heavy_tailed(200, 300)  # partial edge blocks / groups included
    minmax, searched = block_errors(scheme, w, WeightScales.MINMAX), block_errors(scheme, w, WeightScales.MSE)
    assert (searched <= minmax * (1 + 2 * n * U)).all()
    assert (searched < minmax).any()
    total = searched.sum() / minmax.sum()
    print(f"{scheme}: squared error {total:.3f} of min-max")
    if scheme == "nvfp4":
        assert total < 0.95


def test_fp8_search_matches_a_plain_loop_reference():
    w = heavy_tailed(256, 384, seed=1)
    chosen = fp8_block_scales_mse(w)
    blocks = to_blocks(w.double(), FP8_WEIGHT_BLOCK)
    for i in range(blocks.shape[0]):
        for j in range(blocks.shape[1]):
            block = blocks[i, j]
            errors = []
            for clip in FP8_CLIP_GRID:
                scale = fp8_scale_from_amax(block.abs().max().float() * clip).double()
                decoded = to_e4m3((block / scale).float()).double() * scale
                errors.append((decoded - block).pow(2).sum().item())
            scale = chosen[i, j].double()
            mine = (to_e4m3((block / scale).float()).double() * scale - block).pow(2).sum().item()
            assert mine <= min(errors) * (1 + 2 * FP8_WEIGHT_BLOCK**2 * U) + 1e-300, (i, j)


def test_nvfp4_search_matches_a_plain_loop_reference():
    w = heavy_tailed(24, 96, seed=2)
    gs = nvfp4_global_scale(w.abs().amax())
    groups = nvfp4_groups(w)
    chosen = nvfp4_block_scales_mse(groups, gs)
    minmax = nvfp4_block_scales(groups.abs().amax(-1), gs)
    for r in range(groups.shape[0]):
        for g in range(groups.shape[1]):
            group = groups[r, g]
            errors = []
            base = int(minmax[r, g].view(torch.uint8))
            for step in NVFP4_SCALE_CODE_STEPS:
                code = min(max(base + step, 1), 0x7E)
                scale = torch.tensor(code, dtype=torch.uint8).view(torch.float8_e4m3fn).float() * gs
                decoded = e2m1_to_float(round_to_e2m1(group / scale)) * scale
                errors.append((decoded.double() - group.double()).pow(2).sum().item())
            scale = chosen[r, g].float() * gs
            mine = (e2m1_to_float(round_to_e2m1(group / scale)).double() * scale - group.double()).pow(2).sum().item()
            assert mine <= min(errors) * (1 + 2 * NVFP4_GROUP * U), (r, g, mine, errors)


def test_searched_scales_keep_every_contract():
    """Zeros stay exact (zero blocks / groups keep scale 1.0), non-finite weights are refused by name, the FP8 path
    is quantize_fp8_block with the searched scale, and every searched NVFP4 scale is a positive finite E4M3."""
    w = heavy_tailed(130, 140, seed=3)
    w[:, :16] = 0.0
    w[:128, :128] = 0.0  # one all-zero FP8 block
    enc = SCHEMES["fp8_block"].encode(w, "w", WeightScales.MSE)
    q, scale = quantize_fp8_block(w, scale=fp8_block_scales_mse(w))
    assert torch.equal(enc["weight"].view(torch.uint8), q.view(torch.uint8)) and torch.equal(enc["weight_scale"], scale)
    assert scale[0, 0] == 1.0
    nv = SCHEMES["nvfp4"].encode(w, "w", WeightScales.MSE)
    bs = nv["weight_scale"].float()
    assert torch.isfinite(bs).all() and (bs > 0).all() and (bs[:, 0] == 1.0).all()
    assert (SCHEMES["nvfp4"].decode(nv, w.shape[1])[:, :16] == 0).all()
    bad = w.clone()
    bad[3, 5] = math.nan
    for scheme in SCHEMES.values():
        with pytest.raises(ValueError, match=r"model.x.weight.*non-finite"):
            scheme.encode(bad, "model.x.weight", WeightScales.MSE)


def test_recipes_compose_and_refuse_what_they_cannot_do(tmp_path):
    from quantkit.models.tiny import build_tiny_stock_checkpoint
    from quantkit.quantize.checkpoint import quantize_checkpoint
    from quantkit.quantize.recipe import load_recipe, parse_recipe

    assert load_recipe("w4a4_nvfp4_sq_mse").smoothquant is not None
    assert load_recipe("w4a4_nvfp4_sq_mse").weight_scales == WeightScales.MSE
    with pytest.raises(ValueError, match="weight_scales 'best' is not one of"):
        parse_recipe({"name": "x", "scheme": "nvfp4", "weight_scales": "best"})
    with pytest.raises(ValueError, match="weight_scales applies to quantkit's own quantized schemes"):
        parse_recipe({"name": "x", "scheme": "bf16", "weight_scales": "mse"})
    with pytest.raises(ValueError, match="weight_scales four_over_six is not defined for scheme fp8_block"):
        parse_recipe(
            {
                "name": "x",
                "scheme": "nvfp4",
                "weight_scales": "four_over_six",
                "module_schemes": [{"re:.*self_attn.*": "fp8_block"}],
            }
        )
    with pytest.raises(ValueError, match="four_over_six does not compose with gptq"):
        parse_recipe({"name": "x", "scheme": "nvfp4", "weight_scales": "four_over_six", "gptq": {}})
    assert load_recipe("w4a4_nvfp4_w46").weight_scales == WeightScales.FOUR_OVER_SIX

    source = build_tiny_stock_checkpoint(tmp_path / "llama", "llama", seed=0)
    out = quantize_checkpoint(source, "w4a4_nvfp4_mse", tmp_path / "q", streaming=False)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["weight_scales"] == "mse" and config["recipe"] == "w4a4_nvfp4_mse"
    from safetensors.torch import load_file

    from quantkit.checkpoints import weight_files

    source_state = {k: v for f in weight_files(source) for k, v in load_file(str(f)).items()}
    state = {k: v for f in weight_files(out) for k, v in load_file(str(f)).items()}
    name = config["quantized_modules"][0]
    expected = SCHEMES["nvfp4"].encode(source_state[f"{name}.weight"].float(), name, WeightScales.MSE)
    for suffix, tensor in expected.items():
        assert torch.equal(state[f"{name}.{suffix}"].view(torch.uint8), tensor.view(torch.uint8)), suffix
