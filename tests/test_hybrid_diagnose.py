"""Diagnostics of the hybrid linear-attention MoE family (docs/diagnostics.md, "Hybrid MoE models").

The tiny hybrid (quantkit.models.tiny_hybrid: 4 layers = 3 Gated DeltaNet + 1 gated softmax layer 3, 8 experts
top-2 plus a shared expert in every layer) with planted properties the statistics must find:

- sink statistics only on the softmax layer: with the queries zeroed, causal softmax attention is uniform,
  a_{t0} = 1 / (t + 1) exactly, so alpha_0 = H_T / T (harmonic number) for T <= 64 and the sink rate is 1
  when that exceeds 0.3 (T = 4: 25/48);
- a router forced onto one expert: every token has it in its top-k -> token fraction 1, load 1/k;
- an outlier planted in one expert's down_proj input (its up_proj rows scaled by 2^10) -> that expert's max;
- per-expert SNR under FP8 and NVFP4, the same figure in `quantkit diagnose` and `quantkit quality`;
and a dense control: every layer softmax, no experts section (tests/test_diagnose.py covers the dense path).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_diagnose import run_diagnose_cli

from quantkit.diagnose.plots import figures
from quantkit.diagnose.run import diagnose_model
from quantkit.formats.experts import EXPERT_MATRIX
from quantkit.models.configuration_hybrid import QuantkitHybridConfig
from quantkit.models.modeling_hybrid import QuantkitHybridForCausalLM
from quantkit.models.tiny import MICRO_SHAPE, randomize_parameters
from quantkit.models.tiny_hybrid import HYBRID_RANDOM_PARAMETER_RULES, TINY_HYBRID_SHAPE

pytestmark = pytest.mark.cpu_isa  # run again with AVX2 kernels forced on AVX-512 CPUs (Makefile `test`)

BOS, VOCAB = 1, 97
EXPERTS, TOP_K = TINY_HYBRID_SHAPE["num_experts"], TINY_HYBRID_SHAPE["num_experts_per_tok"]
# Two roundings to 6 significant digits (5e-6 relative each), over the smallest the expected value can be.
REPORT_ROUNDING_REL = 2 * 5e-6 / (1 - 5e-6)
SOFTMAX_LAYER = 3  # Qwen3-Next's full_attention_interval 4: layers 0-2 Gated DeltaNet


def _model(seed: int = 0) -> QuantkitHybridForCausalLM:
    torch.manual_seed(seed)
    config = QuantkitHybridConfig(
        vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=2, pad_token_id=0, **TINY_HYBRID_SHAPE
    )
    model = QuantkitHybridForCausalLM(config)
    randomize_parameters(model, 0.05, HYBRID_RANDOM_PARAMETER_RULES)
    return model.eval()


def _tokens(n: int = 4, t: int = 32, seed: int = 1) -> torch.Tensor:
    tokens = torch.randint(3, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))
    tokens[:, 0] = BOS
    return tokens


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_sink_statistics_only_on_softmax_layers_residual_on_all():
    """Zeroed queries (the q half of Qwen3-Next's fused [q; gate] rows): q_norm(0) = 0, RoPE(0) = 0, every logit
    0, so causal softmax gives a_{t0} = 1/(t+1) exactly up to float32 rounding (1e-6). T = 4 <= T_eps = 64:
    alpha_0 = first-token mass = (1 + 1/2 + 1/3 + 1/4) / 4 = 25/48 > 0.3 in every head -> sink rate 1.
    The residual statistics cover all D + 1 = 5 states, DeltaNet layers included; the (1 + w) norm reports its
    scale 1 + w (stored w = -0.75 -> 0.25)."""
    model = _model()
    attn = model.model.layers[SOFTMAX_LAYER].self_attn
    hd, heads = attn.head_dim, model.config.num_attention_heads
    with torch.no_grad():
        attn.q_proj.weight.view(heads, 2 * hd, -1)[:, :hd] = 0.0
        model.model.layers[1].input_layernorm.weight[7] = -0.75
    r = diagnose_model(model, _tokens(t=4), recipes=[])
    att = r["attention"]
    assert att["layers"] == [SOFTMAX_LAYER]
    assert [s["layer"] for s in att["skipped"]] == [0, 1, 2]
    assert all("linear attention" in s["reason"] and "linear_attn" in s["reason"] for s in att["skipped"])
    assert len(att["sink_rate"]) == len(att["alpha"]) == len(att["first_token_mass_layer"]) == 1
    assert att["alpha"][0] == pytest.approx([25 / 48] * heads, abs=1e-6)
    assert att["first_token_mass_layer"][0] == pytest.approx(25 / 48, abs=1e-6)
    assert att["sink_rate"] == [1.0]
    assert [row[0] for row in att["map"]] == pytest.approx([1.0, 1 / 2, 1 / 3, 1 / 4], abs=1e-6)
    assert r["summary"]["softmax_layers"] == [SOFTMAX_LAYER] and r["summary"]["attention_skipped_layers"] == [0, 1, 2]
    assert r["summary"]["sink_rate_max"] == 1.0

    assert len(r["residual"]["max_abs"]) == len(r["residual"]["mean_abs_per_dim"]) == 5
    assert all(m > 0 for m in r["residual"]["max_abs"])
    norms = {(n["name"], n["param"]): n for n in r["norms"]}
    weight = norms[("model.layers.1.input_layernorm", "weight")]
    assert weight["convention"] == "1 + w" and weight["values"][7] == pytest.approx(0.25)
    assert weight["top_dims"][0] == {"dim": 7, "value": pytest.approx(0.25)}
    assert _hooks(model) == 0
    assert {"attention_sinks", "attention_map", "expert_load", "expert_maxima"} <= set(figures(r))


def test_router_forced_to_one_expert_gives_it_every_token():
    """Layer 0: residual dim J = 30 for every token (embedding column), untouched by the DeltaNet branch (its
    out_proj row J zeroed), so the post-attention norm output y_J = 30 / rms(x) * (1 + 0) > 0. Router row
    FORCED = e_J, every other row 0: logit FORCED > 0 = every other logit, so FORCED is in every token's top-k
    (the k - 1 other slots are ties at 0). Exact counts: token fraction 1, load 1/k, loads summing to 1, max
    load x E = E / k. Every token reaches the experts, so the largest gate/up input over a layer's experts is
    the max |x| of the shared expert's input (the same tensor), in every layer."""
    forced, j = 5, 11
    model = _model()
    layer = model.model.layers[0]
    with torch.no_grad():
        model.model.embed_tokens.weight[:, j] = 30.0
        layer.linear_attn.out_proj.weight[j] = 0.0
        layer.post_attention_layernorm.weight[j] = 0.0
        layer.mlp.gate.weight.zero_()
        layer.mlp.gate.weight[forced, j] = 1.0
    tokens = _tokens()
    r = diagnose_model(model, tokens, recipes=[])
    ex = r["experts"]["model.layers.0.mlp.experts"]
    assert ex["layer"] == 0 and ex["top_k"] == TOP_K and ex["tokens"] == tokens.numel()
    assert ex["token_fraction"][forced] == 1.0 and ex["load"][forced] == 1 / TOP_K
    assert sum(ex["load"]) == pytest.approx(1.0, abs=1e-12)
    assert ex["max_load_ratio"] == EXPERTS / TOP_K
    assert r["summary"]["max_expert_load_ratio"] == EXPERTS / TOP_K
    assert r["summary"]["max_expert_load_at"] == "model.layers.0.mlp.experts"
    for i in range(4):
        e = r["experts"][f"model.layers.{i}.mlp.experts"]
        assert sum(e["load"]) == pytest.approx(1.0, abs=1e-12)
        shared = r["linears"][f"model.layers.{i}.mlp.shared_expert.gate_proj"]["max_abs"]
        assert max(v for v in e["gate_up_input_max"] if v is not None) == shared
    assert ex["gate_up_input_max"][forced] == r["linears"]["model.layers.0.mlp.shared_expert.gate_proj"]["max_abs"]


def test_planted_down_proj_outlier_is_found_at_that_expert():
    """Last layer (its experts feed nothing the diagnostics read before them), expert E, its up_proj row C
    (C = its top down_proj-input channel without the plant) times 2^10: h_C = act(g_C) * u_C scales by exactly
    2^10 (a power of two commutes with float rounding), so E's max down_proj input becomes 1024 x its old max,
    still at channel C; the routing and every other expert's statistics are unchanged (bitwise).

    The report rounds every float to 6 significant digits (`diagnose.run`), each within 5e-6 relative of its
    value, so 1024 x the rounded old maximum and the rounded new one differ by at most 2 x 5e-6 relative (to
    within 5e-6 of that): the bound below. The values themselves scale exactly (checked on the recomputed
    expert pass: the power of two commutes with every rounding); which value gets rounded differs by CPU."""
    expert, name = 6, f"model.layers.{SOFTMAX_LAYER}.mlp.experts"
    tokens = _tokens()
    model = _model()
    before = diagnose_model(model, tokens, recipes=[])["experts"]
    channel = before[name]["down_input_top_channel"][expert]
    old_max = before[name]["down_input_max"][expert]
    assert all(v < 1024 * old_max for ex in before.values() for v in ex["down_input_max"])  # O(1) vs ~1000
    experts = model.model.layers[SOFTMAX_LAYER].mlp.experts
    intermediate = experts.down_proj.shape[2]
    with torch.no_grad():
        experts.gate_up_proj[expert, intermediate + channel] *= 1024.0
    r = diagnose_model(model, tokens, recipes=[])
    after = r["experts"]
    assert after[name]["down_input_max"][expert] == pytest.approx(1024 * old_max, rel=REPORT_ROUNDING_REL)
    assert after[name]["down_input_top_channel"][expert] == channel
    assert after[name]["down_input_top_experts"][0]["expert"] == expert
    assert r["summary"]["max_expert_down_input_at"] == f"{name}.{expert}.down_proj"
    for key in ("load", "gate_up_input_max"):
        assert after[name][key] == before[name][key]
    assert [v for e, v in enumerate(after[name]["down_input_max"]) if e != expert] == [
        v for e, v in enumerate(before[name]["down_input_max"]) if e != expert
    ]
    for other in (n for n in before if n != name):
        assert after[other] == before[other]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A tiny hybrid checkpoint and its per-token FP8 block and NVFP4 quantizations."""
    from quantkit.models.tiny_hybrid import build_tiny_hybrid_checkpoint
    from quantkit.quantize.checkpoint import quantize_checkpoint

    root = tmp_path_factory.mktemp("hybrid_diag")
    source = build_tiny_hybrid_checkpoint(root / "source")
    return source, {r: quantize_checkpoint(source, r, root / r) for r in ("w8a8_fp8_block", "w4a4_nvfp4")}


def test_expert_snr_per_scheme_in_quality_and_diagnose(quantized, tmp_path, capsys):
    """SNR per expert matrix (y = x W^T on the routed tokens) under both schemes, from `quantkit quality` (the
    quantized checkpoint's decoded weights) and `quantkit diagnose` (the recipe emulated on the source).

    Bounds: round-to-nearest with t mantissa bits leaves a relative error of RMS 2^-t / sqrt(12) x sqrt(0.541)
    per operand (0.541 = mean of 1/v^2 over a binade for log-uniform v); x and W both rounded: SNR ~
    -10 log10(2 x 0.541 x 2^-2t / 12) = 28.5 dB for E4M3 (t = 3), 16.5 dB for E2M1 (t = 1). The tiny model's
    Gaussian weights and activations are not log-uniform (NVFP4's FP8 group scales, E2M1's coarse steps near
    0): +-4 dB around those values, and FP8 >= NVFP4 + 6 dB (one mantissa bit is 6 dB; E4M3 has two more).
    diagnose and quality compute the same products on the same held-out windows (diagnose with eager attention,
    quality with SDPA: inputs equal to ~1e-6 relative, flipping a negligible fraction of roundings), and the
    JSON keeps 6 significant digits: equal to 0.01 dB."""
    from quantkit.quantize.quality import quality_table

    source, dirs = quantized
    table, rows = quality_table(source, list(dirs.values()), num_sequences=4, seq_len=64)
    cli = ("--out", tmp_path / "d", "--num-sequences", 4, "--seq-len", 64, "--recipes", *dirs)
    assert run_diagnose_cli(source, *cli) == 0
    printed = capsys.readouterr().out
    assert all(f"attention-sink statistics skip layer {i}: linear attention" in printed for i in (0, 1, 2))
    assert all(
        (tmp_path / "d" / f"{f}.svg").exists()
        for f in ("expert_load", "expert_maxima", "expert_snr", "attention_sinks")
    )
    diag = json.loads((tmp_path / "d" / "diagnostics.json").read_text())

    modules = [f"model.layers.{i}.mlp.experts" for i in range(4)]
    estimate = {"w8a8_fp8_block": 28.5, "w4a4_nvfp4": 16.5}
    assert "| recipe | experts | gate_proj SNR min / median (dB) |" in table
    for row in rows:
        recipe = row["recipe"]
        quantized_modules = json.loads((dirs[recipe] / "config.json").read_text())["quantization_config"][
            "quantized_modules"
        ]
        experts = {n for n in row["layer_snr_db"] if EXPERT_MATRIX.match(n)}
        assert experts and experts <= set(quantized_modules)
        assert list(row["expert_snr_db"]) == modules
        for module in modules:
            routed = sum(v is not None for v in diag["experts"][module]["down_input_max"])
            for proj in ("gate_proj", "up_proj", "down_proj"):
                s = row["expert_snr_db"][module][proj]
                assert s["experts"] == routed and s["min"] <= s["median"]
                assert abs(s["median"] - estimate[recipe]) < 4
                assert s["min"] == row["layer_snr_db"][f"{module}.{s['min_expert']}.{proj}"]
                assert f"| {recipe} | {module} |" in table
        for matrix in experts:
            assert diag["quant_snr_db"][recipe][matrix] == pytest.approx(row["layer_snr_db"][matrix], abs=0.01)
        for module in modules:
            for proj, s in row["expert_snr_db"][module].items():
                d = diag["expert_snr_db"][recipe][module][proj]
                assert (d["min"], d["median"], d["experts"]) == (
                    pytest.approx(s["min"], abs=0.01),
                    pytest.approx(s["median"], abs=0.01),
                    s["experts"],
                )
    fp8, nvfp4 = rows
    for module in modules:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert fp8["expert_snr_db"][module][proj]["min"] > nvfp4["expert_snr_db"][module][proj]["median"] + 6


def test_dense_model_control_every_layer_softmax_no_experts():
    """The dense family through the same code: every layer is a softmax layer (nothing skipped), no experts
    section, no expert figures or summary columns, and the quantized matrices are the Linears only."""
    from quantkit.diagnose.run import summary_markdown
    from quantkit.models import QuantkitConfig, QuantkitForCausalLM

    torch.manual_seed(0)
    shape = dict(MICRO_SHAPE, max_position_embeddings=64)
    model = QuantkitForCausalLM(QuantkitConfig(vocab_size=VOCAB, bos_token_id=BOS, pad_token_id=0, **shape)).eval()
    r = diagnose_model(model, _tokens(n=2, t=16), recipes=["w8a8_fp8_block"])
    assert r["attention"]["layers"] == [0, 1] and r["attention"]["skipped"] == []
    assert r["experts"] == {} and r["expert_snr_db"] == {"w8a8_fp8_block": {}}
    assert not any(EXPERT_MATRIX.match(n) for n in r["quant_snr_db"]["w8a8_fp8_block"])
    assert "max_expert_load_ratio" not in r["summary"] and "expert" not in summary_markdown([r])
    assert not {"expert_load", "expert_maxima", "expert_snr"} & set(figures(r))
    assert all("convention" not in n for n in r["norms"])
