"""AWQ (Lin et al. 2024; recipe key `smoothquant.scales: awq`, `quantkit.calibrate.alpha_search`): per mapping, the
scales mean|X|^r / w_mean^(1 - r) (normalized) of llm-compressor's grid with the least error of the consumers'
quantized products, folded as SmoothQuant's factors are.

- The grid and the weight means are llm-compressor's own (run in its venv, tests/llmcompressor_awq.py).
- The scale formula on hand-derived cases; the search's choice is the candidate of least recorded error.
- The whole-model and streaming paths write the same bytes and the fold is function-preserving (quantize checks it
  and raises otherwise); the checkpoint records `scales: awq`.
"""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from quantkit.calibrate.alpha_search import AWQ_GRID, awq_factors, weight_mean
from quantkit.quantize.recipe import load_recipe


def test_grid_and_weight_means_are_llmcompressors(tmp_path):
    """AWQ_GRID is `AWQModifier(n_grid=20, duo_scaling=True)._get_grid_search_params()` exactly; `weight_mean` is
    `AWQModifier._compute_layer_means` on the same layers for NVFP4 groups of 16 and FP8 128x128 blocks (shapes
    that divide the blocks: theirs needs it; ours pads). Both divide |w| by its block max + 1e-6 in float32 (the
    same IEEE operations) and sum over rows in higher precision; ours rounds the mean to float32 once: relative
    difference <= 2^-24 plus the float64 sums' order (~1e-15), so 2^-23 is asserted."""
    from quantkit.quantize.llmcompressor_backend import llmcompressor_python

    g = torch.Generator().manual_seed(0)
    cases = [
        {"scheme": "nvfp4", "weights": [torch.randn(48, 64, generator=g), torch.randn(16, 64, generator=g) * 3]},
        {"scheme": "fp8_block", "weights": [torch.randn(256, 128, generator=g) * torch.rand(128, generator=g)]},
    ]
    torch.save(cases, tmp_path / "cases.pt")
    worker = Path(__file__).with_name("llmcompressor_awq.py")
    subprocess.run(
        [str(llmcompressor_python()), str(worker), str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")], check=True
    )
    theirs = torch.load(tmp_path / "out.pt")
    assert [tuple(p) for p in theirs["grid"]] == list(AWQ_GRID)
    for case, mean in zip(cases, theirs["means"], strict=True):
        block = (1, 16) if case["scheme"] == "nvfp4" else (128, 128)
        ours = weight_mean(case["weights"], [block] * len(case["weights"]))
        assert ((ours.double() - mean.double()).abs() <= 2**-23 * mean.double().abs()).all(), case["scheme"]


def test_awq_factors_follow_the_formula():
    """(0, no weight term) is the identity; every candidate is normalized so that max(s) min(s) = 1 (to float32
    rounding); with the weight term, s_j / s_i = (x_i / x_j)^-r (w_j / w_i)^-(1-r) up to the +1e-4 offsets, here
    below 5e-6 relative (w^0.5 >= sqrt(500) = 22.4: 1e-4 / 22.4), plus float32 rounding (~1e-7): 1e-5 is asserted;
    a zero activation channel gets the 1e-4 floor."""
    x = torch.tensor([1.0, 4.0, 100.0, 0.0])
    w = torch.tensor([1.0, 2.0, 0.5, 1.0]) * 1e3
    assert torch.equal(awq_factors(x, w, 0.0, False), torch.ones(4))
    for ratio, duo in AWQ_GRID:
        s = awq_factors(x, w, ratio, duo)
        assert torch.isfinite(s).all() and float(s.max() * s.min()) == pytest.approx(1.0, rel=1e-6)
    s = awq_factors(x, w, 0.5, True)
    want = (x[:3] ** 0.5) / (w[:3] ** 0.5)
    assert (s[:3] / s[0]).tolist() == pytest.approx((want / want[0]).tolist(), rel=1e-5)
    assert float(s[3] / s.max()) == pytest.approx(1e-4 / float((x.sqrt() / w.sqrt()).max()), rel=1e-5)


def test_blocks_pad_at_the_edges():
    """A weight whose shape does not divide the block: the edge blocks are partial (their own max), as the
    formats' scales are."""
    w = torch.zeros(130, 20)
    w[129, 19] = 4.0
    w[0, 0] = 2.0
    mean = weight_mean([w], [(128, 128)])
    assert mean[19] == pytest.approx(4.0 / (4.0 + 1e-6) / 130) and mean[0] == pytest.approx(2.0 / (2.0 + 1e-6) / 130)


def test_awq_records_its_choice_and_both_paths_write_the_same_bytes(tmp_path):
    """On a tiny Llama with every AWQ mapping (norm -> q/k/v, v -> o, norm -> gate/up, up -> down): each mapping's
    recorded ratio is the grid's of least recorded error (20 errors each); the whole-model and streaming paths run
    the same float32 operations on the same batches, so they write the same bytes; the checkpoint records `scales:
    awq`; and the choice is not the identity everywhere, so the checkpoint differs from plain W4A4's."""
    from safetensors.torch import load_file

    from quantkit.checkpoints import weight_files
    from quantkit.models.tiny import build_tiny_stock_checkpoint
    from quantkit.quantize.checkpoint import quantize_checkpoint

    def state_of(model_dir) -> dict[str, torch.Tensor]:
        return {k: v for f in weight_files(model_dir) for k, v in load_file(str(f)).items()}

    source = build_tiny_stock_checkpoint(tmp_path / "llama", "llama", seed=0)
    recipe = tmp_path / "awq.yaml"
    recipe.write_text(
        "name: awq\nscheme: nvfp4\nsmoothquant: {scales: awq, num_sequences: 8, seq_len: 32, include_v_o: true, "
        "include_up_down: true}\n"
    )
    whole = quantize_checkpoint(source, str(recipe), tmp_path / "w", streaming=False)
    stream = quantize_checkpoint(source, str(recipe), tmp_path / "s", streaming=True)
    plain = quantize_checkpoint(source, "w4a4_nvfp4", tmp_path / "p", streaming=False)
    report = json.loads((whole / "smoothquant.json").read_text())
    ratios = [r for r, _ in AWQ_GRID]
    assert report["alpha_grid"] == ratios
    kinds = {m["kind"] for m in report["mappings"]}
    assert len(report["mappings"]) >= 4 and len(kinds) >= 3, kinds
    for m in report["mappings"]:
        errors = report["alpha_errors"][m["name"]]
        assert len(errors) == len(AWQ_GRID) and m["alpha"] == ratios[errors.index(min(errors))]
    assert json.loads((stream / "smoothquant.json").read_text())["mappings"] == report["mappings"]
    a, b, c = state_of(whole), state_of(stream), state_of(plain)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if k in c)
    qc = json.loads((whole / "config.json").read_text())["quantization_config"]
    assert qc["smoothquant"]["scales"] == "awq"


def test_named_recipes_load():
    for name in ("w4a4_nvfp4_awq", "w4a4_nvfp4_awq_gptq_mse"):
        recipe = load_recipe(name)
        assert recipe.smoothquant is not None and recipe.smoothquant.scales == "awq"
        assert recipe.smoothing_search(lambda *a: None).weight_block("model.layers.0.mlp.down_proj") == (1, 16)


def test_the_weights_only_search_quantizes_the_weights_alone():
    """`smoothquant.search_weights_only` (llm-compressor's AWQ objective: its calibration forward runs with activation
    quantization disabled): the plan's searched product is x @ Q(W)^T with x in float32, where the default is
    Q(x) @ Q(W)^T. Both sides run the same float32 operations on the same operands (the NVFP4 weight fake-quant,
    bit-exact to the reference in tests/test_formats.py, then one matmul), so equality is exact. The recipe records
    the key, the row label says it, and the key without a search is refused on load."""
    import yaml
    from transformers import LlamaConfig

    from quantkit.formats.schemes import scheme_for
    from quantkit.pipelines.study import _precision
    from quantkit.quantize.plan import QuantPlan
    from quantkit.quantize.recipe import parse_recipe

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    name = "model.layers.0.mlp.down_proj"
    torch.manual_seed(0)
    x, w = torch.randn(32, 128), torch.randn(64, 128)
    x[:, 5] *= 40.0  # an outlier channel: per-token activation quantization then loses the small ones
    nvfp4 = scheme_for("nvfp4")
    weights_only = x @ nvfp4.fake_quant_weight(w, name).T
    both = nvfp4.fake_quant_activation(x) @ nvfp4.fake_quant_weight(w, name).T
    products = {}
    for recipe_name in ("w4a4_nvfp4_static_awq_wonly", "w4a4_nvfp4_static_awq"):
        plan = QuantPlan.resolve(load_recipe(recipe_name), config, [name])
        products[recipe_name] = plan.smoothquant.search.product(name, x, w)
    assert torch.equal(products["w4a4_nvfp4_static_awq_wonly"], weights_only)
    assert torch.equal(products["w4a4_nvfp4_static_awq"], both)
    assert not torch.equal(weights_only, both)
    assert load_recipe("w4a4_nvfp4_static_awq_wonly").smoothquant.search_weights_only
    assert _precision("w4a4_nvfp4_static_awq_wonly") == "W4A4+AWQ(W) (static)"
    with pytest.raises(ValueError, match="search_weights_only needs a search"):
        parse_recipe(yaml.safe_load("name: r\nscheme: nvfp4\nsmoothquant: {search_weights_only: true}\n"), "r.yaml")


def test_the_parent_of_a_mapping_is_its_consumers_lowest_common_ancestor():
    from quantkit.calibrate.alpha_search import parent_of

    attn = [f"model.layers.3.self_attn.{p}_proj" for p in "qkv"]
    assert parent_of(attn) == "model.layers.3.self_attn"
    assert parent_of(["model.layers.3.mlp.gate_proj", "model.layers.3.mlp.up_proj"]) == "model.layers.3.mlp"
    assert parent_of(["model.layers.3.mlp.down_proj"]) == "model.layers.3.mlp.down_proj"
    with pytest.raises(ValueError, match="share no parent"):
        parent_of(["a.q", "b.k"])


def test_the_parent_output_error_is_the_mlps_own_output_error_and_the_weights_come_back():
    """`choose_scales_by_parent` on a Llama MLP (gate/up the quantized consumers, down_proj float32): each
    candidate's error is sum ||mlp(x; W <- Q(W s) / s) - mlp(x)||^2, recomputed here with the same float32
    operations in the same order (F.linear, SiLU, product, F.linear), so equal exactly; the least error wins; the
    consumers' weights are the same tensors, unchanged, after the search."""
    import torch.nn.functional as F
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from quantkit.calibrate.alpha_search import AlphaSearch, choose_scales_by_parent
    from quantkit.quantize.fake_quant import quantized_product, quantized_weight

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=96)).eval()
    x = torch.randn(2, 16, 64)
    x[..., 7] *= 30.0
    recipe = load_recipe("w4a4_nvfp4_static_awq_parent")
    weight = quantized_weight(recipe)
    search = AlphaSearch(
        quantized_product(recipe, activations=False),
        rule="awq",
        weight_block=recipe.weight_block_of,
        parent_output=True,
        weight=weight,
    )
    with torch.no_grad():
        reference = mlp(x)
    candidates = [torch.ones(64), 1.0 + torch.rand(64), (x.abs().mean((0, 1)) ** 0.5)]
    originals = {n: getattr(mlp, n).weight for n in ("gate_proj", "up_proj", "down_proj")}
    copies = {n: w.detach().clone() for n, w in originals.items()}
    consumers = [("model.layers.0.mlp.gate_proj", mlp.gate_proj), ("model.layers.0.mlp.up_proj", mlp.up_proj)]
    best, errors = choose_scales_by_parent(
        search, mlp, [((x,), {}, reference)], consumers, torch.arange(64), candidates
    )

    def by_hand(s: torch.Tensor) -> float:
        gate = weight("model.layers.0.mlp.gate_proj", copies["gate_proj"] * s) / s
        up = weight("model.layers.0.mlp.up_proj", copies["up_proj"] * s) / s
        out = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), copies["down_proj"])
        return float((out - reference).pow(2).sum())

    assert errors == [by_hand(s) for s in candidates]
    assert best == errors.index(min(errors)) and len(set(errors)) == len(errors)
    for n, w in originals.items():
        assert getattr(mlp, n).weight is w and torch.equal(w, copies[n])


def test_each_search_error_chooses_by_its_own_error_and_both_paths_write_the_same_bytes(tmp_path):
    """On a tiny Llama with every AWQ mapping, three objectives: the served products (default), the products with
    the weights alone quantized (`search_weights_only`) and the parent module's output (`search_parent_output`:
    llm-compressor's; the q/k/v mapping's parent is self_attn, re-run with its recorded keyword arguments, rotary
    embeddings and mask). Each mapping records the ratio of least recorded error; each objective records other
    errors than the others; the parent search's whole-model and streaming paths write the same bytes (the same
    float32 operations on the same batches); the checkpoint records the keys; and search_parent_output without
    search_weights_only is refused on load."""
    import yaml
    from safetensors.torch import load_file

    from quantkit.checkpoints import weight_files
    from quantkit.models.tiny import build_tiny_stock_checkpoint
    from quantkit.quantize.checkpoint import quantize_checkpoint
    from quantkit.quantize.recipe import parse_recipe

    def state_of(model_dir) -> dict[str, torch.Tensor]:
        return {k: v for f in weight_files(model_dir) for k, v in load_file(str(f)).items()}

    source = build_tiny_stock_checkpoint(tmp_path / "llama", "llama", seed=0)
    settings = "scales: awq, num_sequences: 8, seq_len: 32, include_v_o: true, include_up_down: true"
    objectives = {
        "products": "",
        "wonly": ", search_weights_only: true",
        "parent": ", search_weights_only: true, search_parent_output: true",
    }
    errors_of = {}
    for name, extra in objectives.items():
        (tmp_path / f"{name}.yaml").write_text(f"name: {name}\nscheme: nvfp4\nsmoothquant: {{{settings}{extra}}}\n")
        out = quantize_checkpoint(source, str(tmp_path / f"{name}.yaml"), tmp_path / name, streaming=False)
        report = json.loads((out / "smoothquant.json").read_text())
        assert len({m["kind"] for m in report["mappings"]}) >= 3
        ratios = [r for r, _ in AWQ_GRID]
        for m in report["mappings"]:
            errors = report["alpha_errors"][m["name"]]
            assert len(errors) == len(AWQ_GRID) and m["alpha"] == ratios[errors.index(min(errors))]
        errors_of[name] = report["alpha_errors"]
    attention = [n for n in errors_of["parent"] if n.endswith("q_proj, k_proj, v_proj")]
    assert attention
    for n in attention:
        assert errors_of["parent"][n] != errors_of["wonly"][n] != errors_of["products"][n]
    stream = quantize_checkpoint(source, str(tmp_path / "parent.yaml"), tmp_path / "s", streaming=True)
    a, b = state_of(tmp_path / "parent"), state_of(stream)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    qc = json.loads((tmp_path / "parent" / "config.json").read_text())["quantization_config"]
    assert qc["smoothquant"]["search_parent_output"] is True and qc["smoothquant"]["search_weights_only"] is True
    with pytest.raises(ValueError, match="set search_weights_only: true with it"):
        parse_recipe(
            yaml.safe_load("name: r\nscheme: nvfp4\nsmoothquant: {scales: awq, search_parent_output: true}\n"), "r.yaml"
        )
