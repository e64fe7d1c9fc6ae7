"""SmoothQuant's alpha search (`quantkit.calibrate.alpha_search`, recipe key `smoothquant.search_alpha`): each
mapping's alpha is the grid's of least quantized output error, measured with the served quantizers; recorded in
smoothquant.json; the whole-model and streaming paths write the same bytes; MoE norms keep the recipe's alpha."""

import json

import pytest
import torch
import yaml

from quantkit.calibrate.alpha_search import DEFAULT_GRID, AlphaSearch, choose_alpha
from quantkit.calibrate.smoothquant import smoothing_factors
from quantkit.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4_activation, quantize_nvfp4_weight
from quantkit.quantize.fake_quant import quantized_product
from quantkit.quantize.recipe import load_recipe, parse_recipe


def state_of(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from quantkit.checkpoints import weight_files

    return {k: v for f in weight_files(model_dir) for k, v in load_file(str(f)).items()}


def test_each_alpha_is_scored_by_the_nvfp4_reference_and_the_least_error_wins():
    """The errors `choose_alpha` reports for an NVFP4 recipe are those of the pure-torch NVFP4 reference (quantize,
    then dequantize weight and per-token activation; the fast fake-quant is bit-exact to it, tests/test_formats.py):
    the same float32 operations, so equal up to the order of the final float32 sum of ~1e4 squares, whose relative
    error is below log2(1e4) x 2^-24 ~ 1e-6 (pairwise summation); 1e-5 is asserted. The chosen alpha is the
    grid's of least error. Inputs: a token x channel matrix with three channels 50x the rest (the outliers
    SmoothQuant exists for) and weights with one large column, so the error differs between alphas."""
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    x[:, [3, 17, 40]] *= 50.0
    weights = [("q", torch.randn(48, 64)), ("k", torch.randn(16, 64))]
    weights[0][1][:, 9] *= 20.0
    x_max = x.abs().amax(0)
    w_max = torch.stack([w.abs().amax(0) for _, w in weights]).amax(0)
    search = AlphaSearch(quantized_product(load_recipe("w4a4_nvfp4")))
    chosen, errors = choose_alpha(search, x, weights, torch.arange(64), lambda a: smoothing_factors(x_max, w_max, a))

    def reference_error(alpha: float) -> float:
        s = smoothing_factors(x_max, w_max, alpha)
        xq = dequantize_nvfp4(quantize_nvfp4_activation(x / s))
        return sum(
            float((xq @ dequantize_nvfp4(quantize_nvfp4_weight(w * s)).T - x @ w.T).pow(2).sum()) for _, w in weights
        )

    assert errors == pytest.approx([reference_error(a) for a in DEFAULT_GRID], rel=1e-5)
    assert chosen == DEFAULT_GRID[errors.index(min(errors))]
    assert max(errors) > 1.5 * min(errors)  # the alphas differ, so the choice means something


def test_the_named_recipe_searches_and_says_so_in_its_row_label():
    from quantkit.pipelines.study import _precision

    recipe = load_recipe("w4a4_nvfp4_sq_search")
    assert recipe.smoothquant is not None and recipe.smoothquant.search_alpha
    assert _precision("w4a4_nvfp4_sq_search") == "W4A4+SQ(search)" and _precision("w4a4_nvfp4_sq") == "W4A4+SQ"


def test_a_bad_grid_or_row_count_is_refused():
    product = quantized_product(load_recipe("w4a4_nvfp4"))
    with pytest.raises(ValueError, match=r"alphas in \[0, 1\]"):
        AlphaSearch(product, grid=(0.5, 1.5))
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        AlphaSearch(product, max_rows=0)


@pytest.mark.parametrize(
    "extra, message",
    [
        ("smoothquant: {search_alpha: maybe}\n", "smoothquant.search_alpha must be true or false"),
        ("smoothquant: {scales: aqw}\n", r"smoothquant.scales must be one of \['smoothquant', 'awq'\]"),
        ("smoothquant: {scales: awq, search_alpha: true}\n", "searches its own grid"),
        ("smoothquant: {scales: awq, include_v_o: true}\nrotation: {online_o: true}\n", "include_v_o does not compose"),
    ],
)
def test_a_bad_search_or_awq_setting_fails_on_load(extra, message):
    with pytest.raises(ValueError, match=message):
        parse_recipe(yaml.safe_load(f"name: r\nscheme: nvfp4\n{extra}"), "r.yaml")


def test_the_search_records_its_choice_and_both_paths_write_the_same_bytes(tmp_path):
    """On a tiny Llama: every dense mapping gets an alpha of the grid, the grid's of least recorded error (in
    smoothquant.json beside each mapping's figures); the whole-model and streaming paths run the same float32
    operations on the same batches, so they write the same bytes; the fold is checked function-preserving by
    quantize itself (it raises otherwise); and the search leaves alpha 0.5 on this seeded model (0.4, 0.3, 0.7, 0.5
    when written), so its checkpoint differs from the fixed-alpha one."""
    from quantkit.models.tiny import build_tiny_stock_checkpoint
    from quantkit.quantize.checkpoint import quantize_checkpoint

    source = build_tiny_stock_checkpoint(tmp_path / "llama", "llama", seed=0)
    for name, extra in (("sq_search", ", search_alpha: true"), ("sq_fixed", "")):
        (tmp_path / f"{name}.yaml").write_text(
            f"name: {name}\nscheme: nvfp4\nsmoothquant: {{num_sequences: 8, seq_len: 32{extra}}}\n"
        )
    whole = quantize_checkpoint(source, str(tmp_path / "sq_search.yaml"), tmp_path / "w", streaming=False)
    stream = quantize_checkpoint(source, str(tmp_path / "sq_search.yaml"), tmp_path / "s", streaming=True)
    fixed = quantize_checkpoint(source, str(tmp_path / "sq_fixed.yaml"), tmp_path / "f", streaming=False)
    report = json.loads((whole / "smoothquant.json").read_text())
    assert report["alpha_grid"] == list(DEFAULT_GRID)
    assert report["mappings"] and set(report["alpha_errors"]) == {m["name"] for m in report["mappings"]}
    for m in report["mappings"]:
        errors = report["alpha_errors"][m["name"]]
        assert m["alpha"] == DEFAULT_GRID[errors.index(min(errors))]
    assert json.loads((stream / "smoothquant.json").read_text())["mappings"] == report["mappings"]
    a, b = state_of(whole), state_of(stream)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {m["alpha"] for m in report["mappings"]} != {0.5}  # this seeded model's search leaves the paper's 0.5
    c = state_of(fixed)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_moe_norms_keep_the_recipes_alpha(tmp_path):
    """A MoE layer's post_attention_layernorm feeds fused experts (no Linear to measure): its mapping keeps the
    recipe's alpha and records no errors, while the attention mapping of the same layer is searched."""
    from quantkit.models.tiny import build_tiny_stock_checkpoint
    from quantkit.quantize.checkpoint import quantize_checkpoint

    source = build_tiny_stock_checkpoint(tmp_path / "moe", "qwen3_moe", seed=0)
    (tmp_path / "sq_search.yaml").write_text(
        "name: sq_search\nscheme: nvfp4\nsmoothquant: {alpha: 0.3, num_sequences: 8, seq_len: 32, search_alpha: true}\n"
    )
    out = quantize_checkpoint(source, str(tmp_path / "sq_search.yaml"), tmp_path / "q", streaming=False)
    report = json.loads((out / "smoothquant.json").read_text())
    moe = [m for m in report["mappings"] if "post_attention_layernorm" in m["smooth"]]
    attention = [m for m in report["mappings"] if "input_layernorm" in m["smooth"]]
    assert moe and attention
    assert all(m["alpha"] == 0.3 and m["name"] not in report["alpha_errors"] for m in moe)
    assert all(m["name"] in report["alpha_errors"] for m in attention)
