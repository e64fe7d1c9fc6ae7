"""SmoothQuant: mappings per variant, exact folding (function preserved), and that smoothing smooths.

Models are tiny float32 QuantkitForCausalLM / Llama / Qwen3 built in memory with `randomize_parameters`
(embeddings N(0, 1), so the residual stream and DyT's tanh are O(1)), with outlier channels injected so
that every mapping has something to migrate. Two injections, each in its own model: "norms" (one channel
of each norm weight x30: activation outliers at q/k/v(/g) and gate/up inputs) and "projections" (one row
of v_proj and of up_proj x30: outliers at o_proj and down_proj inputs). Kept apart because a large v_proj
or up_proj row also enlarges every column max of that weight, which (correctly) damps the norm mapping's
factors. The control for each mapping: the injected channel is the largest and smoothing shrinks it.
Hidden size 72 and intermediate 136 are deliberately not multiples of 16.

Tolerances (derived): folding is exact in real arithmetic; in float32 each folded weight is rounded once or
twice (<= 2**-23 relative) and the forward then rounds differently, ~ lambda sqrt(K) u relative per dot product
(u = 2**-24, K <= 136: ~1e-5 at lambda = 10, Higham & Mary 2019), a few ops per layer, 2 layers: the
held-out logits move by O(1e-6 .. 1e-5) of their max, so `relative change < 1e-4` holds on any ISA, while a
missing fold moves them by > 1e-2 (test_gated_norm_needs_the_gate_down_fold). The report's act_max_after is
max|X| / s, the measured one is computed through the folded weights: same noise class, rel 1e-4.
act_max_before is the same statistic of the same unsmoothed forward, rel 1e-6 (~16 ulps: order only).
Outlier shrink (x1/2) and spread shrink (x1/2) are properties of the injected x30 channels (margins >> 2 by
construction: alpha = 0.5 divides a x30 channel by ~sqrt(30)); the seeded weights are the same draw on
every ISA up to the last bit.
"""

import copy
import functools
import json
import logging
import math

import pytest
import torch
from test_variants_hf import VARIANTS as FLAG_VARIANTS
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from quantkit.calibrate import (
    FunctionPreservationError,
    NonFiniteStatisticsError,
    SmoothQuantMappingError,
    channel_max,
    resolve_mappings,
    smooth_model,
    smoothing_factors,
)
from quantkit.calibrate import mappings as mappings_module
from quantkit.data import calibration_windows, heldout_texts
from quantkit.models import QuantkitConfig, QuantkitForCausalLM
from quantkit.models.modeling import QuantkitNorm
from quantkit.models.tiny import MICRO_SHAPE, randomize_parameters

pytestmark = pytest.mark.cpu_isa  # run again with AVX2 kernels forced on AVX-512 CPUs (Makefile `test`)

# 72 / 136 wide: no multiple of a 16- or 128-wide block
SHAPE = dict(
    MICRO_SHAPE,
    vocab_size=96,
    hidden_size=72,
    intermediate_size=136,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
# test_variants_hf's flag table (the Gated Attention flags with a head-wise gate) and PreAffine / GatedNorm alone
VARIANTS = {**FLAG_VARIANTS, "pre_affine": dict(pre_affine=True), "gated_norm": dict(gated_norm_rank=16)}
NO_V_O = {"v_scale", "headwise_rmsnorm"}  # attention not linear in v: v_proj -> o_proj refused
OUTLIER = {"input_layernorm": 5, "post_attention_layernorm": 7, "v_proj": 3, "up_proj": 9}


INJECTIONS = {
    "norms": ("input_layernorm", "post_attention_layernorm"),
    "projections": ("self_attn.v_proj", "mlp.up_proj"),
}


def randomize(model: nn.Module, injection: str | None = "norms") -> nn.Module:
    """Random parameters, N(0, 1) embeddings, and one persistent outlier channel x30 per injected layer."""
    randomize_parameters(model, 0.05)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        for layer in model.model.layers:
            for path in INJECTIONS.get(injection, ()):
                layer.get_submodule(path).weight[OUTLIER[path.rsplit(".", 1)[-1]]] *= 30
    return model.eval()


def quantkit_model(seed: int = 0, injection: str | None = "norms", **flags) -> QuantkitForCausalLM:
    torch.manual_seed(seed)
    return randomize(QuantkitForCausalLM(QuantkitConfig(**SHAPE, **flags)), injection)


def tokens(n: int = 16, length: int = 32, seed: int = 1) -> torch.Tensor:
    out = torch.randint(1, SHAPE["vocab_size"], (n, length), generator=torch.Generator().manual_seed(seed))
    out[:, 0] = SHAPE["bos_token_id"]  # BOS at position 0 (the attention-sink variant requires it)
    return out


@torch.no_grad()
def logits(model: nn.Module, toks: torch.Tensor) -> torch.Tensor:
    return model(input_ids=toks, use_cache=False).logits


def relative_change(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def check_preserved_and_smoothed(model: nn.Module, include_v_o: bool, injection: str, **kwargs) -> dict:
    """Smooth `model`; assert logits unchanged (own check, not only the report's), consumer weights changed,
    and for each injected mapping: the outlier channel is the largest, halves at least, and so does the
    spread max/median of max |x| at the consumers' input (measured with hooks after smoothing)."""
    calib, held_out = tokens(16, 32, seed=1), tokens(4, 32, seed=2)
    plan = resolve_mappings(model, include_v_o=include_v_o, include_up_down=True)
    consumers = [c for m in plan.mappings for c in m.consumers]
    before_stats = channel_max(model, calib, consumers, progress=False)
    before_weights = {c: model.get_submodule(c).weight.detach().clone() for c in consumers}
    reference = logits(model, held_out)

    report = smooth_model(model, calib, include_v_o=include_v_o, include_up_down=True, progress=False, **kwargs)

    change = relative_change(logits(model, held_out), reference)
    assert change < 1e-4, f"held-out logits moved by {change:.3g} of their scale"
    assert report.relative_logit_change < 1e-4
    after_stats = channel_max(model, calib, consumers, progress=False)
    checked = 0
    for m, r in zip(plan.mappings, report.mappings):
        c = m.consumers[0]
        before, after = before_stats[c], after_stats[c]
        if (m.kind == "norm") == (injection == "norms"):
            # the control: the injected channel is the largest, and smoothing shrinks it and the spread
            j = before.argmax()
            smooth = m.smooth.rsplit(".", 1)[-1]
            assert (j % m.head_dim if m.kind == "v_o" else j) == OUTLIER[smooth], (
                f"{m.name}: largest channel {j} is not the injected one"
            )
            assert after[j] < before[j] / 2, (
                f"{m.name}: outlier channel {j} did not shrink ({before[j]:.3g} -> {after[j]:.3g})"
            )
            assert after.max() / after.median() < (before.max() / before.median()) / 2, (
                f"{m.name}: spread did not shrink"
            )
            checked += 1
        # the report's prediction max|X|/s matches the measured range after smoothing
        assert r.act_max_after == pytest.approx(after.max().item(), rel=1e-4)
        assert r.act_max_before == pytest.approx(before.max().item(), rel=1e-6)
        assert not torch.allclose(model.get_submodule(c).weight, before_weights[c]), f"{c} unchanged"
    assert checked >= 2
    json.dumps(report.to_dict())
    return {"relative_logit_change": change, "report": report}


@pytest.mark.parametrize("injection", list(INJECTIONS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_smoothing_preserves_function_and_shrinks_outliers(variant, injection):
    model = quantkit_model(injection=injection, **VARIANTS[variant])
    result = check_preserved_and_smoothed(model, include_v_o=variant not in NO_V_O, injection=injection)
    report = result["report"]
    kinds = {m.kind for m in report.mappings}
    assert kinds == ({"norm", "up_down"} if variant in NO_V_O else {"norm", "v_o", "up_down"})
    if variant.startswith("ga_"):  # the gate reads the normed input: it is a consumer of input_layernorm
        assert report.mappings[0].consumers[-1].endswith("self_attn.g_proj")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_power_of_two_factors_fold_bit_exactly_in_bf16(variant):
    model = quantkit_model(**VARIANTS[variant]).to(torch.bfloat16)
    reference = logits(model, tokens(4, 32, seed=2))
    report = smooth_model(
        model, tokens(8, 32), include_v_o=variant not in NO_V_O, include_up_down=True, power_of_two=True, progress=False
    )
    assert report.tolerance == 1e-3
    assert torch.equal(logits(model, tokens(4, 32, seed=2)), reference)
    s = torch.cat(list(report.scales.values()))
    assert torch.equal(s, torch.exp2(torch.log2(s).round())) and (s != 1).any()


def _stock_config(cls, **overrides):
    return cls(**{**SHAPE, **overrides})


@pytest.mark.parametrize("injection", list(INJECTIONS))
@pytest.mark.parametrize(
    "model_cls, config",
    [
        (Qwen3ForCausalLM, _stock_config(Qwen3Config)),
        # MQA (4 query heads share 1 KV head) and biases on q/k/v/o and the MLP
        (LlamaForCausalLM, _stock_config(LlamaConfig, num_key_value_heads=1, attention_bias=True, mlp_bias=True)),
    ],
    ids=["qwen3", "llama_mqa_bias"],
)
def test_stock_architectures(model_cls, config, injection):
    torch.manual_seed(0)
    model = randomize(model_cls(config), injection)
    result = check_preserved_and_smoothed(model, include_v_o=True, injection=injection)
    assert result["report"].architecture == model_cls.__name__


def test_v_o_refused_where_attention_is_not_linear_in_v():
    for flags, reason in ((dict(value_scale=True), "V-scale"), (dict(headwise_rmsnorm=True), "head-wise RMSNorm")):
        model = quantkit_model(**flags)
        with pytest.raises(SmoothQuantMappingError, match=f"v_proj -> o_proj .*not function-preserving.*{reason}"):
            smooth_model(model, tokens(), include_v_o=True, progress=False)
        report = smooth_model(model, tokens(), progress=False)  # skipped by default, with the reason
        assert any("v_proj -> o_proj: not valid here" in s and reason in s for s in report.skipped)
        assert {m.kind for m in report.mappings} == {"norm"}


def test_unknown_structure_errors_name_the_modules():
    class Mystery(nn.Module):
        def __init__(self, hidden):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden))

        def forward(self, x):
            return x * self.weight

    model = quantkit_model()
    model.model.layers[1].post_attention_layernorm = Mystery(SHAPE["hidden_size"])
    model.model.layers[0].mlp.extra = nn.Linear(4, 4)
    with pytest.raises(SmoothQuantMappingError) as err:
        resolve_mappings(model)
    message = str(err.value)
    assert "model.layers.1.post_attention_layernorm (Mystery: no fold registered)" in message
    assert "model.layers.0.mlp.extra (a linear no mapping accounts for)" in message

    del model.model.layers[0].self_attn.v_proj
    with pytest.raises(SmoothQuantMappingError, match=r"model\.layers\.0\.self_attn\.v_proj \(missing\)"):
        resolve_mappings(model)

    with pytest.raises(SmoothQuantMappingError, match=r"no decoder layers at model\.model\.layers.*'encoder'"):
        resolve_mappings(nn.ModuleDict({"encoder": nn.Linear(2, 2)}))

    class UnregisteredLM(QuantkitForCausalLM):  # same structure, unknown name: norm mappings, traced
        pass

    model = UnregisteredLM(QuantkitConfig(**SHAPE))
    traced = resolve_mappings(model).mappings
    assert {m.kind for m in traced} == {"norm"}
    assert [(m.smooth, m.consumers) for m in traced] == [
        (m.smooth, m.consumers) for m in resolve_mappings(quantkit_model()).mappings
    ]
    with pytest.raises(
        SmoothQuantMappingError, match=r"up_proj -> down_proj smoothing needs a registered architecture"
    ):
        resolve_mappings(model, include_up_down=True)
    with pytest.raises(SmoothQuantMappingError, match="v_proj -> o_proj smoothing needs a registered architecture"):
        resolve_mappings(model, include_v_o=True)

    model = quantkit_model()
    model.model.layers[0].mlp = nn.Sequential()  # not a known GLU MLP; up_proj etc. missing
    with pytest.raises(SmoothQuantMappingError, match=r"model\.layers\.0\.mlp\.up_proj \(missing\)"):
        resolve_mappings(model, include_up_down=True)


def test_nan_statistics_error_names_the_layer_and_leaves_the_model():
    model = quantkit_model()
    with torch.no_grad():
        model.model.layers[1].input_layernorm.weight[3] = float("nan")
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(NonFiniteStatisticsError, match=r"model\.layers\.1\.self_attn\.q_proj \(NaN in 1 channels"):
        smooth_model(model, tokens(), progress=False)
    assert all(torch.equal(v.nan_to_num(), state[k].nan_to_num()) for k, v in model.state_dict().items())


def test_gated_norm_needs_the_gate_down_fold():
    """Without multiplying gate_down's columns by s, GatedNorm is not function-preserving."""
    held_out = tokens(4, 32, seed=2)
    model = quantkit_model(gated_norm_rank=16)
    reference = logits(model, held_out)
    report = smooth_model(model, tokens(), progress=False)
    assert relative_change(logits(model, held_out), reference) < 1e-4
    with torch.no_grad():  # undo only the gate_down part of each fold
        for name, s in report.scales.items():
            model.get_submodule(name).gate_down.weight.div_(s[None, :])
    assert relative_change(logits(model, held_out), reference) > 1e-2


def test_gated_norm_without_gate_fold_fails_the_check_and_is_undone(monkeypatch):
    monkeypatch.setitem(
        mappings_module._FOLDS, QuantkitNorm, functools.partial(mappings_module.fold_quantkit_norm, fold_gate=False)
    )
    model = quantkit_model(gated_norm_rank=16)
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(FunctionPreservationError, match=r"max \|logit change\| .* above the tolerance 0\.001"):
        smooth_model(model, tokens(), progress=False)
    for k, v in model.state_dict().items():  # undone by the inverse fold: <= 2 float32 roundings, 2**-23 relative
        torch.testing.assert_close(v, state[k], rtol=1e-5, atol=1e-7)


def test_smoothing_factors_formula_and_clamps():
    x = torch.tensor([16.0, 1.0, 0.0, 4.0, 1e12])
    w = torch.tensor([1.0, 4.0, 2.0, 0.0, 1e-12])
    s = smoothing_factors(x, w, alpha=0.5)
    torch.testing.assert_close(s[:2], torch.tensor([4.0, 0.5]))
    assert s[2] == 1 and s[3] == 1  # dead activation / zero weight column: nothing to migrate
    assert s[4] == 1e4  # clamped to SCALE_MAX
    torch.testing.assert_close(smoothing_factors(x[:2], w[:2], alpha=1.0), x[:2])
    torch.testing.assert_close(
        smoothing_factors(torch.tensor([3.0]), torch.tensor([1.0]), power_of_two=True), torch.tensor([2.0])
    )
    with pytest.raises(ValueError, match="alpha must be in"):
        smoothing_factors(x, w, alpha=1.5)


def test_calibration_windows_from_the_training_speeches(caplog):
    from quantkit.models.tokenizer import train_bpe_tokenizer

    texts = heldout_texts()
    tokenizer = train_bpe_tokenizer(texts, 300)
    batch = calibration_windows(tokenizer, 8, 64, "speeches")
    assert batch.shape == (8, 64) and batch.dtype == torch.long
    assert (batch[:, 0] == tokenizer.bos_token_id).all()
    assert len({tuple(row.tolist()) for row in batch}) == 8
    with caplog.at_level(logging.WARNING, logger="quantkit.data"):
        calibration_windows(tokenizer, 4096, 128, texts[:1])
    assert "windows overlap" in caplog.text

    # end to end from text (a quantkit model's default: the training speeches), on the variant that needs BOS first
    torch.manual_seed(0)
    model = randomize(
        QuantkitForCausalLM(QuantkitConfig(**{**SHAPE, "vocab_size": len(tokenizer)}, attention_sink=True))
    )
    report = smooth_model(model, None, tokenizer, num_sequences=8, seq_len=64, progress=False)
    assert (report.num_sequences, report.seq_len) == (8, 64)
    assert report.relative_logit_change < 1e-4


def test_token_input_validation():
    model = quantkit_model()
    with pytest.raises(ValueError, match="only 16 token sequences"):
        smooth_model(model, tokens(16), num_sequences=32, progress=False)
    with pytest.raises(ValueError, match="seq_len=64"):
        smooth_model(model, tokens(16, 32), seq_len=64, progress=False)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        smooth_model(model, ["some text"], progress=False)
    report = smooth_model(model, [tokens(4), tokens(4, seed=3)], progress=False)  # iterable of batches
    assert report.num_sequences == 8


@pytest.mark.parametrize("architecture", ["gemma2", "gemma3"])
def test_gemma_table_entry_maps_its_sandwich_norms_as_the_structural_rule_does(architecture, tmp_path):
    """The table entry of Gemma 2 and 3 (`SANDWICH`) maps input_layernorm -> q/k/v and pre_feedforward_layernorm ->
    gate/up (their post-attention and post-feedforward norms feed the residual, not a linear): the same norm mappings
    the traced structural rule finds on each. v_proj -> o_proj (softmax attention; Gemma 2's soft-capping acts on the
    logits) and up_proj -> down_proj (a GLU) come on top, one each per layer; `quantize` verifies the function is
    preserved (it raises otherwise). Streaming writes the same checkpoint."""
    from transformers import AutoModelForCausalLM

    from quantkit.calibrate.mappings import traced_mappings
    from quantkit.models.tiny import build_tiny_stock_checkpoint
    from quantkit.quantize.checkpoint import quantize_checkpoint

    source = build_tiny_stock_checkpoint(tmp_path / architecture, architecture)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    plan = resolve_mappings(model)
    assert [(m.smooth.split(".", 3)[-1], tuple(c.rsplit(".", 1)[-1] for c in m.consumers)) for m in plan.mappings] == [
        ("input_layernorm", ("q_proj", "k_proj", "v_proj")),
        ("pre_feedforward_layernorm", ("gate_proj", "up_proj")),
    ] * model.config.num_hidden_layers
    traced = traced_mappings(model, type(model).__name__, model.model.layers)
    assert [(m.smooth, m.consumers) for m in traced.mappings] == [(m.smooth, m.consumers) for m in plan.mappings]
    full = resolve_mappings(model, include_v_o=True, include_up_down=True)
    leaf = lambda name: name.rsplit(".", 1)[-1]  # noqa: E731
    pairs = [(leaf(m.smooth), leaf(m.consumers[0])) for m in full.mappings if m.kind != "norm"]
    assert sorted(pairs) == sorted([("v_proj", "o_proj"), ("up_proj", "down_proj")] * model.config.num_hidden_layers)
    updown = tmp_path / "sq_updown.yaml"
    updown.write_text(
        "name: sq_updown\nscheme: nvfp4\nsmoothquant: {alpha: 0.5, num_sequences: 4, seq_len: 32, "
        "include_v_o: true, include_up_down: true}\n"
    )
    quantize_checkpoint(source, str(updown), tmp_path / "updown", streaming=False)  # raises unless preserved
    recipe = tmp_path / "sq_tiny.yaml"
    recipe.write_text("name: sq_tiny\nscheme: fp8_block\nsmoothquant: {alpha: 0.5, num_sequences: 4, seq_len: 32}\n")
    out = quantize_checkpoint(source, str(recipe), tmp_path / "q", streaming=False)
    assert json.loads((out / "smoothquant.json").read_text())["architecture"] == type(model).__name__
    # the streaming path maps its meta skeleton by the same table, one layer at a time: the same checkpoint
    from quantkit.checkpoints import read_state

    streamed = quantize_checkpoint(source, str(recipe), tmp_path / "q2", streaming=True)
    whole, stream = read_state(out), read_state(streamed)
    assert whole.keys() == stream.keys() and all(torch.equal(whole[k], stream[k]) for k in whole)
    assert (out / "smoothquant.json").read_text() == (streamed / "smoothquant.json").read_text()

    class Mystery(nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.weight = norm.weight

        def forward(self, x):
            return x * self.weight

    model.model.layers[0].input_layernorm = Mystery(model.model.layers[0].input_layernorm)
    with pytest.raises(
        SmoothQuantMappingError,
        match=r"layers\.0\.input_layernorm \(Mystery: no fold registered\)"
        r".*Recipes without SmoothQuant .* still work",
    ):
        resolve_mappings(model)


def test_settling_needs_evidence_and_patience():
    """`stats.Settling`: the relative L2 change of each maxima vector per batch; settled only after min_windows,
    with `patience` batches in a row under the tolerance; an observer that saw nothing never settles."""
    from types import SimpleNamespace

    from quantkit.calibrate.stats import EarlyStop, Settling

    observer = SimpleNamespace(maxima={})
    settling = Settling(observer, EarlyStop(tolerance=0.1, patience=2, min_windows=16))
    assert not any(settling.after_batch(8) for _ in range(6))  # nothing observed: no evidence
    observer.maxima = {"a": torch.tensor([1.0, 2.0])}
    settling = Settling(observer, EarlyStop(tolerance=0.1, patience=2, min_windows=16))
    steps = []
    for growth in [None, 0.5, 0.01, 0.01, 0.3, 0.0, 0.0]:
        if growth is not None:
            observer.maxima = {"a": observer.maxima["a"] * (1 + growth)}
        steps.append(settling.after_batch(8))
    # change = growth / (1 + growth) relative to the new norm; the first batch has nothing to compare with
    assert settling.change[0] == math.inf and settling.change[1] == pytest.approx(0.5 / 1.5)
    assert steps == [False, False, False, True, False, False, True]
    assert settling.windows == 56
