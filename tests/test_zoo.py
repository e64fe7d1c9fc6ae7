"""The zoo trains a variant from scratch on the offline corpus, writes its artifacts, and reuses them."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantkit.models import zoo

STEPS = 12


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


@pytest.mark.parametrize("variant", zoo.TABLE2_PRESETS)
def test_table2_presets_build(variant, zoo_dir):
    out = zoo.build(variant, zoo_dir=zoo_dir, steps=STEPS)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert {k: getattr(model.config, k) for k in zoo.PRESETS[variant]} == zoo.PRESETS[variant]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["heldout"]["loss"] < json.loads((out / "loss_curve.json").read_text())[0]["loss"]


def test_build_trains_writes_artifacts_and_resumes(zoo_dir):
    steps = STEPS
    out = zoo.build("ga_gatednorm", zoo_dir=zoo_dir, steps=steps)
    assert out == zoo_dir / "ga_gatednorm-tiny"
    metrics = json.loads((out / "metrics.json").read_text())
    curve = json.loads((out / "loss_curve.json").read_text())
    assert len(curve) == steps and (out / "loss_curve.png").stat().st_size > 1000
    vocab = zoo.SIZES["tiny"].vocab_size
    assert curve[0]["loss"] > curve[-1]["loss"] and abs(curve[0]["loss"] - torch.log(torch.tensor(vocab)).item()) < 0.5
    assert metrics["variant_name"] == "GA(headwise)+GatedNorm(r16)"
    assert metrics["heldout"]["max_abs_residual"] > 0 and metrics["heldout"]["loss"] < curve[0]["loss"]
    assert "max |activation|" in (out / "README.md").read_text()

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.gated_norm_rank == 16 and len(tok) == model.config.vocab_size
    # the shared tokenizer is trained once; a finished checkpoint is reused, not retrained
    assert (zoo_dir / f"tokenizer-{vocab}" / "streams.pt").exists()
    stamp = (out / "metrics.json").stat().st_mtime_ns
    assert zoo.build("ga_gatednorm", zoo_dir=zoo_dir, steps=steps) == out
    assert (out / "metrics.json").stat().st_mtime_ns == stamp


def test_unknown_variant_group_and_size_are_refused(tmp_path):
    with pytest.raises(zoo.ZooError, match="unknown zoo variant 'gated_attention'"):
        zoo.build("gated_attention", zoo_dir=tmp_path)
    with pytest.raises(zoo.ZooError, match="unknown zoo size 'huge'"):
        zoo.build("ga", size="huge", zoo_dir=tmp_path)
    with pytest.raises(
        zoo.ZooError, match=r"unknown zoo size 'small' for hybrid preset 'hybrid_ga'; sizes: \['tiny'\]"
    ):
        zoo.build("hybrid_ga", size="small", zoo_dir=tmp_path)
    with pytest.raises(zoo.ZooError, match=r"unknown zoo variant\(s\) \['table3'\]"):
        zoo.expand(["table2-hybrid", "table3"])
    assert zoo.expand(["table2-hybrid", "ga"]) == ["hybrid_ga", "hybrid_ga_preaffine", "hybrid_ga_gatednorm", "ga"]
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_cli_lists_presets_with_family():
    out = subprocess.run(
        [Path(sys.executable).parent / "quantkit", "zoo", "list"], capture_output=True, text=True, check=True
    )
    rows = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines() if line.split()[0] in zoo.PRESETS}
    assert rows == {name: ("hybrid" if name in zoo.HYBRID_PRESETS else "dense") for name in zoo.PRESETS}
    assert set(zoo.HYBRID_PRESETS) == {"hybrid_ga", "hybrid_ga_preaffine", "hybrid_ga_gatednorm"}
    assert "group table2-hybrid: hybrid_ga, hybrid_ga_preaffine, hybrid_ga_gatednorm" in out.stdout
    assert "hybrid sizes: tiny (4x128, 8 experts top-2" in out.stdout


# --- the hybrid family (Qwen3-Next + flags, docs/hybrid.md) ---

HYBRID = "hybrid_ga_gatednorm"  # GatedNorm on every residual norm, the DeltaNet layers' included


@pytest.fixture(scope="module")
def hybrid_build(zoo_dir):
    """A tiny-steps build of one hybrid preset: STEPS steps of 16 x 128 tokens. Measured on the shared 2-core
    machine: 15-24 s with the module's tokenizer already trained, 100 s alone (the tokenizer takes ~75 s)."""
    return zoo.build(HYBRID, zoo_dir=zoo_dir, steps=STEPS)


def test_hybrid_preset_builds_loads_and_learns(hybrid_build):
    """The checkpoint loads in transformers as the hybrid class vLLM registers, its loss curve falls, and its
    held-out loss is reproduced by the reloaded weights.

    Bounds. Initial loss: the init draws matrices N(0, 0.02) and the final (1 + w) norm starts at w = 0, so a
    logit is a sum of 128 unit-RMS channels times 0.02: std s = 0.02 * sqrt(128) = 0.23, and the cross-entropy is
    ln(V) + s^2/2 + O(s^4) = ln(2048) + 0.03; 0.5 leaves room for the embedding/attention part of the residual
    stream. Decrease: at init the per-token loss varies by ~s around ln V, so a batch mean over 16 * 127 tokens
    varies by ~0.005; a drop of 0.1 (20 x that) is learning, not batch noise. Reload: the same float32 weights
    and windows give the same held-out loss up to summation order (<1e-5 relative) and the same routing.
    """
    from quantkit.serve.plugin import ARCHITECTURES

    out = hybrid_build
    curve = json.loads((out / "loss_curve.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    vocab = zoo.HYBRID_SIZES["tiny"].vocab_size
    assert len(curve) == STEPS and (out / "loss_curve.png").stat().st_size > 1000
    assert abs(curve[0]["loss"] - math.log(vocab)) < 0.5
    assert curve[-1]["loss"] < curve[0]["loss"] - 0.1
    assert metrics["heldout"]["loss"] < curve[0]["loss"] - 0.1
    assert metrics["family"] == "hybrid" and metrics["variant_name"] == "GA(elementwise)+GatedNorm(r16)"

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "QuantkitHybridForCausalLM" and model.config.architectures == [
        "QuantkitHybridForCausalLM"
    ]
    assert model.config.architectures[0] in ARCHITECTURES  # what the vLLM plugin registers
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (model.config.num_experts, model.config.num_experts_per_tok, model.config.head_dim) == (8, 2, 64)
    assert model.config.linear_key_head_dim == model.config.linear_value_head_dim == 64  # vLLM CPU refuses 32
    assert model.config.router_aux_loss_coef == zoo.ROUTER_AUX_LOSS_COEF and not model.config.output_router_logits
    assert {k: getattr(model.config, k) for k in zoo.PRESETS[HYBRID]} == zoo.PRESETS[HYBRID]
    _, _, heldout = zoo.shared_tokenizer(out.parent, vocab)
    reloaded = zoo.evaluate(model, heldout, zoo.HYBRID_SIZES["tiny"].seq_len)
    assert reloaded["loss"] == pytest.approx(metrics["heldout"]["loss"], rel=1e-5)
    # the routing too; a top-2 choice could only flip at a router-probability tie within float32 rounding
    # (~1e-7): allow 8 of the 8192 held-out assignments per layer (1e-3)
    torch.testing.assert_close(
        torch.tensor(reloaded["expert_load"]), torch.tensor(metrics["heldout"]["expert_load"]), atol=1e-3, rtol=0
    )


def test_hybrid_card_records_router_balance(hybrid_build):
    """The per-expert router load at the end of training is in metrics.json and the card; the balance loss is
    logged every step.

    Load: per MoE layer each of the 8 experts' share of the top-2 assignments on held-out text; shares sum to 1
    (float32 division of integer counts: 1e-6). Balance loss at step 0: E * sum_e f_e P_e with a near-uniform
    random router (logit std 0.23, see above) is top_k * (1 + O(0.23^2)) = 2 +- 0.2.
    """
    out = hybrid_build
    metrics = json.loads((out / "metrics.json").read_text())
    curve = json.loads((out / "loss_curve.json").read_text())
    load = metrics["heldout"]["expert_load"]
    assert len(load) == 4 and all(len(row) == 8 and abs(sum(row) - 1) < 1e-6 and min(row) >= 0 for row in load)
    assert all(math.isfinite(c["aux_loss"]) and c["aux_loss"] > 0 for c in curve)
    assert abs(curve[0]["aux_loss"] - 2) < 0.2
    assert metrics["router_aux_loss_coef"] == zoo.ROUTER_AUX_LOSS_COEF
    card = (out / "README.md").read_text()
    assert "Router load per expert" in card and "family hybrid" in card
    for layer, row in enumerate(load):
        assert f"| {layer} | " + " | ".join(f"{x:.3f}" for x in row) in card


def test_zoo_source_resolves_hybrid_preset_for_the_study(hybrid_build, zoo_dir):
    """`zoo:<hybrid preset>` in a study spec resolves to the zoo checkpoint (the finished build is reused)."""
    from quantkit.pipelines.study import StudySpec, resolve_source

    spec = StudySpec(
        name="t", models={"h": f"zoo:{HYBRID}"}, recipes=["bf16"], zoo={"size": "tiny", "dir": str(zoo_dir)}
    )
    stamp = (hybrid_build / "metrics.json").stat().st_mtime_ns
    assert resolve_source(f"zoo:{HYBRID}", spec) == hybrid_build
    assert (hybrid_build / "metrics.json").stat().st_mtime_ns == stamp


def test_router_balance_loss_is_in_the_training_objective():
    """`zoo.objective` (what `_train` minimizes) contains transformers' router load-balancing loss times
    router_aux_loss_coef: with coefficient c the router gradients differ from coefficient 0 by c * grad(aux).

    float64 model, identical weights and batch. The two runs' forwards are bitwise equal, so the difference is
    the aux term only (the losses themselves are float32: see the asserts). On the last MoE layer's router the
    cross-entropy and aux gradients meet at its logits in float64; the aux path itself runs in float32
    (transformers' .float() in load_balancing_loss_func), whose longest reduction is over 4 layers x 2 x 64 rows:
    worst case 512 * 2^-24 = 3e-5 relative, so 1e-4.
    Earlier layers' routers also change (a nonzero difference), through their own logits and the layers above.
    """
    c = 0.01
    torch.manual_seed(0)
    config = zoo.make_config("hybrid_ga", "tiny", vocab_size=256, bos_token_id=0, eos_token_id=0)
    config.router_aux_loss_coef = c
    with_aux = zoo.FAMILIES["hybrid"].model_class(config).double()
    config0 = zoo.make_config("hybrid_ga", "tiny", vocab_size=256, bos_token_id=0, eos_token_id=0)
    config0.router_aux_loss_coef = 0.0
    without = zoo.FAMILIES["hybrid"].model_class(config0).double()
    without.load_state_dict(with_aux.state_dict())
    batch = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))

    def router_grads(model, loss):
        model.zero_grad()
        loss.backward()
        return [layer.mlp.gate.weight.grad.clone() for layer in model.model.layers]

    total, ce, aux = zoo.objective(with_aux, batch)
    total0, ce0, aux0 = zoo.objective(without, batch)
    # the losses are float32 (transformers upcasts logits to float32 for the cross-entropy): the objective's
    # cross-entropy (total - c * aux) matches the coefficient-0 run to float32 rounding of the total (1e-6 rel)
    assert total0.item() == ce0 and aux == aux0 and ce == pytest.approx(ce0, rel=1e-6)
    assert total.item() - total0.item() == pytest.approx(c * aux, rel=1e-3)  # difference of two ~5.6 float32s: 1e-6 abs
    g, g0 = router_grads(with_aux, total), router_grads(without, total0)
    g_aux = router_grads(without, without(batch, output_router_logits=True).aux_loss)
    assert all((a - b).norm() > 0 for a, b in zip(g, g0))
    assert ((g[-1] - g0[-1]) - c * g_aux[-1]).norm() <= 1e-4 * (c * g_aux[-1]).norm()
    assert (c * g_aux[-1]).norm() > 1e-3 * g0[-1].norm()  # the aux term is not lost in the cross-entropy's rounding
