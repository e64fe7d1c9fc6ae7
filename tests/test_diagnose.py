"""Outlier diagnostics on constructed models with known answers (quantkit.diagnose, docs/diagnostics.md)."""

import argparse
import json

import pytest
import torch

from quantkit.diagnose.cli import add_diagnose_parser
from quantkit.diagnose.plots import figure_svgs
from quantkit.diagnose.run import diagnose, diagnose_model, write_diagnostics
from quantkit.errors import NonFiniteStatisticsError
from quantkit.models import QuantkitConfig, QuantkitForCausalLM
from quantkit.models.tiny import MICRO_SHAPE

pytestmark = pytest.mark.cpu_isa  # run again with AVX2 kernels forced on AVX-512 CPUs (Makefile `test`)

BOS = 1
SHAPE = dict(MICRO_SHAPE, vocab_size=97, bos_token_id=BOS, eos_token_id=2, pad_token_id=0)


def _model(seed: int = 0, **flags) -> QuantkitForCausalLM:
    torch.manual_seed(seed)
    return QuantkitForCausalLM(QuantkitConfig(**SHAPE, **flags)).eval()


def _tokens(n: int = 4, t: int = 40, seed: int = 1) -> torch.Tensor:
    tokens = torch.randint(3, SHAPE["vocab_size"], (n, t), generator=torch.Generator().manual_seed(seed))
    tokens[:, 0] = BOS
    return tokens


def _all_hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_injected_residual_sink_dimension_ranks_first():
    model = _model()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 5] = 30.0  # every token carries 30 in dim 5 from H_0 on
    r = diagnose_model(model, _tokens(), recipes=[])
    assert r["sink_dims"][0]["dim"] == 5
    assert r["sink_dims"][0]["ratio_to_median"] > 100
    assert r["summary"]["top_sink_dims"][0] == 5
    assert r["summary"]["max_residual"] >= 30.0
    assert r["sink_dims"][0]["input_norm_weight_mean"] == pytest.approx(1.0)


def test_massive_tokens_are_not_residual_sinks():
    """A dimension large at every token (a residual sink, as Gemma's) makes no token massive; one token with a
    value r x beyond both the state's median and its own dimension's median is massive, and only that token
    (the old test, max |h_t| > r x the state's median alone, counted all 32 tokens here)."""
    from quantkit.diagnose.observe import DiagnosticsObserver, ResidualState

    observer = DiagnosticsObserver(_model(), {}, massive_ratio=100.0, map_tokens=0)
    h = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0)).abs() + 0.5  # |h| in [0.5, ~4]
    h[:, :, 3] = 1e4  # the residual sink: 1e4 at every token, 2500x the state's median
    state = ResidualState()
    observer._update_residual(state, h)
    assert state.massive == 0
    h[1, 5, 40] = 1e3  # 1e3 > 100 x the median (~1.2) of the state and of dimension 40
    state = ResidualState()
    observer._update_residual(state, h)
    assert state.massive == 1 and state.massive_positions == {5: 1}


def test_attention_head_on_token_zero_gives_sink_rate_one():
    """Layer 0: constant queries along the slowest RoPE pair, zero keys, a large learnable sink key there."""
    model = _model(attention_sink=True, attention_bias=True)
    attn, hd = model.model.layers[0].self_attn, SHAPE["head_dim"]
    j = hd // 2 - 1  # rotate_half pairs (j, j + hd/2); frequency theta^(-(hd-2)/hd): ~no rotation over 40 tokens
    with torch.no_grad():
        attn.q_proj.weight.zero_()
        attn.q_proj.bias.zero_()
        attn.q_proj.bias.view(-1, hd)[:, j] = 1.0  # q_norm -> 4 e_j in every head
        attn.k_proj.weight.zero_()
        attn.k_proj.bias.zero_()  # keys of real tokens 0 -> logits 0
        attn.sink_key.zero_()
        attn.sink_key[:, j] = 50.0  # logit to position 0: 4 * 50 / sqrt(16) = 50
    r = diagnose_model(model, _tokens(), recipes=[])
    att = r["attention"]
    assert att["sink_rate"][0] == 1.0
    assert min(att["alpha"][0]) > 0.99
    assert att["first_token_mass_layer"][0] > 0.99
    assert att["map"][10][0] > 0.5  # averaged with layer 1
    assert r["summary"]["sink_rate_max"] == 1.0


def test_norm_weight_far_from_one_is_reported():
    model = _model(pre_affine=True)
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight[7] = 0.02
        model.model.layers[0].input_layernorm.pre_scale[3] = 6.0
    norms = {(n["name"], n["param"]): n for n in diagnose_model(model, _tokens(n=2), recipes=[])["norms"]}
    post = norms[("model.layers.1.post_attention_layernorm", "weight")]
    assert post["top_dims"][0] == {"dim": 7, "value": pytest.approx(0.02)}
    assert post["min"] == pytest.approx(0.02)
    assert norms[("model.layers.0.input_layernorm", "pre_scale")]["top_dims"][0]["dim"] == 3
    assert norms[("model.layers.0.input_layernorm", "weight")]["max_deviation"] == 0.0


def test_outlier_input_channel_lowers_nvfp4_snr():
    """An intermediate channel 1e4-1e5 x the rest at down_proj's input (its weight column zeroed, so the
    output is not dominated by it) costs NVFP4 its group of 16 and FP8 per-token nearly everything."""
    tokens, name = _tokens(), "model.layers.0.mlp.down_proj"
    recipes = ["w4a4_nvfp4", "w8a8_fp8_block"]
    base = diagnose_model(_model(), tokens, recipes=recipes)["quant_snr_db"]
    model = _model()
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        mlp.gate_proj.weight[3] *= 300
        mlp.up_proj.weight[3] *= 300
        mlp.down_proj.weight[:, 3] = 0.0
    r = diagnose_model(model, tokens, recipes=recipes)
    assert r["linears"][name]["top_channels"][0]["channel"] == 3
    assert r["linears"][name]["channel_max_ratio"] > 1e3
    assert r["quant_snr_db"]["w4a4_nvfp4"][name] < base["w4a4_nvfp4"][name] - 3.0
    assert r["quant_snr_db"]["w8a8_fp8_block"][name] < base["w8a8_fp8_block"][name] - 10.0
    other = "model.layers.1.mlp.down_proj"  # untouched layer: same SNR within noise
    assert r["quant_snr_db"]["w4a4_nvfp4"][other] == pytest.approx(base["w4a4_nvfp4"][other], abs=1.5)
    for recipe in recipes:  # the sensitivity table names the module to keep in higher precision
        table = r["sensitivity"][recipe]
        assert table["mlp.down_proj"]["worst_layer"] == 0
        assert (
            table["mlp.down_proj"]["min_db"]
            == r["quant_snr_db"][recipe][name]
            == min(t["min_db"] for t in table.values())
        )
    assert next(iter(r["sensitivity"]["w8a8_fp8_block"])) == "mlp.down_proj"  # lowest mean first


def test_sensitivity_groups_projection_kinds_and_folds_experts():
    """Kinds are the path inside the decoder layer; routed experts fold into one kind per projection (a layer's
    value is its worst expert); the mean is over layers; non-finite SNRs (exact products) and linears outside
    the layers are left out; kinds come in ascending mean."""
    from quantkit.diagnose.run import sensitivity_markdown
    from quantkit.metrics import sensitivity_by_kind

    snr = {
        "model.layers.0.self_attn.q_proj": 20.0,
        "model.layers.1.self_attn.q_proj": 10.0,
        "model.layers.0.mlp.experts.0.down_proj": 8.0,
        "model.layers.0.mlp.experts.7.down_proj": 4.0,
        "model.layers.1.mlp.experts.3.down_proj": 12.0,
        "model.layers.1.mlp.shared_expert.up_proj": float("inf"),
        "lm_head": 1.0,
    }
    table = sensitivity_by_kind(snr)
    assert list(table) == ["mlp.experts.down_proj", "self_attn.q_proj"]
    assert table["mlp.experts.down_proj"] == {
        "mean_db": 8.0,
        "min_db": 4.0,
        "worst_layer": 0,
        "layers": {0: 4.0, 1: 12.0},
    }
    assert table["self_attn.q_proj"] == {
        "mean_db": 15.0,
        "min_db": 10.0,
        "worst_layer": 1,
        "layers": {0: 20.0, 1: 10.0},
    }
    text = sensitivity_markdown({"sensitivity": {"w4a4_nvfp4": table, "w8a8_fp8_block": {}}})
    assert text.splitlines()[2] == "| mlp.experts.down_proj | 8.0 (4.0 @ 0) |"


def test_hooks_removed_and_attention_restored_also_on_error():
    model = _model(gated_norm_rank=4)
    assert model.config._attn_implementation != "eager" and _all_hooks(model) == 0
    r = diagnose_model(model, _tokens(n=2), recipes=["w4a4_nvfp4_static"])
    assert r["gates"] and r["quant_snr_db"]["w4a4_nvfp4_static"]
    assert _all_hooks(model) == 0
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteStatisticsError, match=r"layers.1.mlp.down_proj"):
        diagnose_model(model, _tokens(n=2), recipes=[])
    assert _all_hooks(model) == 0
    assert model.config._attn_implementation == "sdpa"


def _threshold_in_widest_gap(values: torch.Tensor, low: float, high: float) -> float:
    """The midpoint of the widest gap between sorted `values` inside (low, high): a threshold no value is near."""
    v = torch.cat([torch.tensor([low, high]), values[(values > low) & (values < high)]]).double().sort().values
    i = int((v[1:] - v[:-1]).argmax())
    threshold = float(v[i] + v[i + 1]) / 2
    assert (v[i + 1] - v[i]) / threshold > 1e-3  # >> float32 noise, so counts above it are stable
    return threshold


def test_streaming_statistics_equal_direct_computation():
    """Batch size 1 vs 4, and both vs the direct computation from one full-batch forward.

    Tolerances: continuous statistics agree to rel 1e-5 (max |h|) / 1e-4 (means, kurtosis, alpha): the forwards
    differ only by float32 summation order (different GEMM shapes choose different blockings, per ISA), relative
    ~ lambda sqrt(K) u ~ 1e-6 per op (u = 2**-24, K <= 128), a few ops deep; kurtosis, a ratio of 4th and
    squared 2nd moments, amplifies that by <= 4 + 4 = 8. Thresholded counts are discontinuous, so the test makes
    them stable: the massive-token ratio is placed in the widest gap of the data's own max/median ratios
    (far from every token), and the sink rate (alpha > SINK_EPS = 0.3, fixed by paper 002) may differ from the
    direct count only by heads whose alpha lies within 1e-4 of 0.3.
    """
    model = _model(attn_implementation="eager")
    tokens = _tokens(n=5, t=24)
    with torch.no_grad():
        out = model(tokens, output_hidden_states=True, output_attentions=True)
    ratios = []
    for h in out.hidden_states[:-1]:  # the observer's per-token max/median ratio (quantkit.diagnose.observe)
        a = h.abs()
        ratios.append((a.amax(-1) / a.reshape(a.shape[0], -1).median(dim=1).values[:, None]).flatten())
    massive_ratio = _threshold_in_widest_gap(torch.cat(ratios), 2.5, 4.0)  # many tokens on both sides
    r1 = diagnose_model(model, tokens, recipes=["w4a4_nvfp4"], batch_size=1, massive_ratio=massive_ratio)
    r4 = diagnose_model(model, tokens, recipes=["w4a4_nvfp4"], batch_size=4, massive_ratio=massive_ratio)
    for key in ("residual", "attention", "quant_snr_db", "massive", "sink_dims"):
        if key == "attention":  # sink_rate: thresholded, compared with the direct count below
            a1, a4 = ({k: v for k, v in r[key].items() if k != "sink_rate"} for r in (r1, r4))
            assert json.dumps(a1) == json.dumps(a4) or _close(a1, a4), key
            continue
        assert json.dumps(r1[key]) == json.dumps(r4[key]) or _close(r1[key], r4[key]), key
    for i, h in enumerate(out.hidden_states[:-1]):  # the last entry is after the final norm
        h = h.double()
        kurt = ((h - h.mean()) ** 4).mean() / h.var(unbiased=False) ** 2
        assert r1["residual"]["max_abs"][i] == pytest.approx(h.abs().max().item(), rel=1e-5)
        assert r1["residual"]["kurtosis"][i] == pytest.approx(kurt.item(), rel=1e-4)
        assert r1["residual"]["mean_abs_per_dim"][i] == pytest.approx(h.abs().mean((0, 1)).tolist(), rel=1e-4)
    for layer, a in enumerate(out.attentions):  # (B, H, T, T)
        alpha = a[..., :, 0].mean(-1)  # T < 64: the window is the whole sequence
        assert r1["attention"]["alpha"][layer] == pytest.approx(alpha.mean(0).tolist(), rel=1e-4)
        near = ((alpha - 0.3).abs() <= 1e-4).double().mean().item()  # heads float32 noise may move across 0.3
        for r in (r1, r4):
            assert abs(r["attention"]["sink_rate"][layer] - (alpha > 0.3).double().mean().item()) <= near + 1e-12
        assert r1["attention"]["first_token_mass_layer"][layer] == pytest.approx(alpha.mean().item(), rel=1e-4)


def _close(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return b == pytest.approx(a, rel=1e-4, abs=1e-9)
    return a == b


@pytest.mark.parametrize(
    "flags",
    [
        dict(norm_type="dyt", gated_norm_rank=4),
        dict(value_scale=True, headwise_rmsnorm=True),
        dict(attn_output_gate="elementwise", hidden_act="sigmoid"),
        dict(attention_sink=True, pre_affine=True),
    ],
)
def test_variant_family(flags):
    model = _model(**flags)
    r = diagnose_model(model, _tokens(n=2, t=20), recipes=["w4a4_nvfp4"])
    assert len(r["residual"]["max_abs"]) == 3 and len(r["attention"]["sink_rate"]) == 2
    assert r["quant_snr_db"]["w4a4_nvfp4"] and _all_hooks(model) == 0
    params = {n["param"] for n in r["norms"]}
    assert ({"alpha", "bias"} <= params) == (flags.get("norm_type") == "dyt")
    assert bool(r["gates"]) == bool(flags.get("gated_norm_rank"))


@pytest.mark.parametrize("architecture", ["qwen3", "llama", "gemma3"])
def test_stock_checkpoint_cli_outputs(tmp_path, architecture, capsys):
    from quantkit.models.tiny import build_tiny_stock_checkpoint

    model_dir = build_tiny_stock_checkpoint(tmp_path / architecture, architecture)
    r = diagnose(model_dir, num_sequences=2, seq_len=32, recipes=["w4a4_nvfp4"], progress=False)
    assert r["model"]["architecture"].lower().startswith(architecture)
    assert r["settings"]["position0_is_bos"] and len(r["attention"]["sink_rate"]) == 2
    assert r["norms"] and not r["gates"]
    per_layer = 4 if architecture == "gemma3" else 2  # Gemma 3: input, post-attention, pre/post-feedforward
    weights = [n for n in r["norms"] if n["param"] == "weight"]
    assert len(weights) == per_layer * 2 + 1  # two layers and the final norm
    assert all((n.get("convention") == "1 + w") == (architecture == "gemma3") for n in weights)
    svgs = figure_svgs(r)
    assert set(svgs) >= {"outliers", "residual_heatmap", "attention_map", "norm_weights", "quant_snr"}
    assert all(s.startswith("<svg") for s in svgs.values())
    paths = write_diagnostics(r, tmp_path / "out")
    assert {p.name for p in paths} >= {"diagnostics.json", "summary.md", "outliers.png", "residual_heatmap.svg"}
    assert json.loads((tmp_path / "out" / "diagnostics.json").read_text())["summary"] == r["summary"]
    if architecture != "qwen3":
        return
    cli = ("--out", tmp_path / "cli", "--num-sequences", 1, "--seq-len", 16, "--recipes", "w8a8_fp8_block")
    assert run_diagnose_cli(model_dir, *cli) == 0 and (tmp_path / "cli" / "attention_map.svg").exists()
    printed = capsys.readouterr().out
    assert "| model |" in printed and "| projection (kind) |" in printed
    assert "| projection (kind) |" in (tmp_path / "out" / "summary.md").read_text()


def run_diagnose_cli(*argv) -> int:
    """`quantkit diagnose ARGV...` through the CLI's own parser (each argument as str); its exit code."""
    parser = argparse.ArgumentParser()
    add_diagnose_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["diagnose", *map(str, argv)])
    return args.func(args)


def _assert_close(a, b, path="result"):
    """Equal structures; numbers equal to 1e-5 relative (see the caller's bound)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (path, sorted(set(a) ^ set(b)))
        for k in a:
            _assert_close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-5, abs=0), (path, a, b)
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("kind", ["dense", "hybrid", "gemma3", "mixtral"])
def test_layer_by_layer_diagnose_equals_the_whole_model(tmp_path, kind):
    """`diagnose MODEL_DIR` runs one decoder layer at a time (the head in pieces of HEAD_POSITIONS positions);
    `diagnose_model` runs the whole model. Same float32 operations on the same batches, so the same statistics,
    except the lm_head's input moments, merged from 64-position pieces instead of whole batches (float64 sums in
    another order: ~1e-15 relative). The result keeps 6 significant digits, which can turn such a difference
    into one unit of the 6th digit: numbers agree to 1e-5 relative, everything else exactly. Two batches
    (8 + 2 windows of 72 tokens: two head pieces, one partial) with every default recipe, static included;
    Gemma 3 (tied head, four norms a layer) and Mixtral (routed experts, its checkpoint in the hub's names)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.data import heldout_windows
    from quantkit.diagnose.defaults import DEFAULT_RECIPES

    if kind == "dense":
        from quantkit.models.tiny import build_tiny_checkpoint

        model_dir = build_tiny_checkpoint(
            tmp_path / "m", attn_output_gate="headwise", gated_norm_rank=16, attention_sink=True
        )
    elif kind == "hybrid":
        from quantkit.models.tiny_hybrid import build_tiny_hybrid_checkpoint

        model_dir = build_tiny_hybrid_checkpoint(tmp_path / "m")
    else:
        from quantkit.models.tiny import build_tiny_stock_checkpoint

        model_dir = build_tiny_stock_checkpoint(tmp_path / "m", kind)  # Mixtral: stored in the hub's layout
    layerwise = diagnose(model_dir, num_sequences=10, seq_len=72, recipes=DEFAULT_RECIPES, progress=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    tokens = heldout_windows(AutoTokenizer.from_pretrained(model_dir), 10, 72)
    whole = diagnose_model(model, tokens, recipes=DEFAULT_RECIPES, tokenizer=AutoTokenizer.from_pretrained(model_dir))
    whole["model"]["path"] = str(model_dir)
    _assert_close(layerwise, whole)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown recipe"):
        diagnose_model(_model(), _tokens(n=1), recipes=["w3a3"])
    with pytest.raises(ValueError, match="SmoothQuant"):
        diagnose_model(_model(), _tokens(n=1), recipes=["w4a4_nvfp4_sq"])
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        diagnose(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "quantkit"}}))
    with pytest.raises(ValueError, match="quantized checkpoint"):
        diagnose(tmp_path)
    parser = argparse.ArgumentParser()
    add_diagnose_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["diagnose", str(tmp_path), "--out", str(tmp_path / "o")])
    assert args.func(args) == 2
