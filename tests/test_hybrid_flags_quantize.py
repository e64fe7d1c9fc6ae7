"""SmoothQuant and quantized checkpoints for every flag of quantkit's hybrid family (QuantkitHybridForCausalLM).

Flag cases: test_hybrid_family.FLAG_CASES (GA elementwise / headwise / none, PreAffine, GatedNorm r16, GLU experts,
V-scale, head-wise RMSNorm), each a tiny random float32 model of TINY_HYBRID_SHAPE (3 Gated DeltaNet + 1 gated
softmax layer, 8 experts top-2 + a shared expert) with channel OUTLIER of every residual norm's effective scale
x30, as in test_hybrid_quantize (the stock Qwen3-Next tests, whose helpers and derivations are reused).

Tolerances (derived in test_hybrid_quantize's docstring; nothing here changes the argument):
- Function preservation in float32: relative logit change < 1e-4 (rounding of the folds, ~1e-6 .. 1e-5), while one
  missing fold moves logits by > 1e-2 (controls: the router; GatedNorm's gate_down). The flags add folds that
  are exact in real arithmetic too: PreAffine's pre_scale acts before the normalization and is not touched
  (the fold divides the (1 + w) output scale); GatedNorm's gate_down columns x s keep the gate's value; GLU
  changes only the experts' activation, which no fold touches; head-wise GA's g_proj reads the normed input
  like q/k/v (a consumer).
- Routing: identical top-k ids after smoothing, given the no-near-tie precondition (top-k gap > 1e-5 of the
  logit scale); the control without the router fold changes > 10% of the routes.
- Checkpoints: each recipe's output passes the checker and loads in the fake-quant reference with finite logits
  that differ from the source's; bf16 reloads bit-exactly (bf16-rounded source). Calibration is cut to 2 x 16
  tokens: these tests check that every recipe runs and writes a servable layout, not calibration quality.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_hybrid_family import FLAG_CASES
from test_hybrid_quantize import (
    OUTLIER,
    RECIPES,
    logits,
    relative_change,
    routing_change_after_smoothing,
    tokens,
)
from transformers import AutoModelForCausalLM

from quantkit.calibrate import FunctionPreservationError, SmoothQuantMappingError, resolve_mappings, smooth_model
from quantkit.calibrate.mappings import fold_offset_rmsnorm, input_weight, scale_
from quantkit.formats.experts import EXPERT_MATRIX
from quantkit.models.configuration_hybrid import QuantkitHybridConfig
from quantkit.models.modeling_hybrid import QuantkitHybridForCausalLM, QuantkitHybridNorm
from quantkit.models.tiny import randomize_parameters
from quantkit.models.tiny_hybrid import HYBRID_RANDOM_PARAMETER_RULES, TINY_HYBRID_SHAPE, build_tiny_hybrid_checkpoint
from quantkit.quantize.checkpoint import quantize_checkpoint
from quantkit.quantize.fake_quant import load_fake_quant_model
from quantkit.quantize.recipe import CalibrationSettings, load_recipe
from quantkit.serve.checkpoint_check import check_servable

VOCAB = 256
NONLINEAR_IN_V = {"value_scale", "headwise_rmsnorm"}  # flags under which v_proj -> o_proj is refused


def v_o_valid(flags: dict) -> bool:
    return not any(flags.get(f) for f in NONLINEAR_IN_V)


def tiny_hybrid(flags: dict, seed: int = 0) -> QuantkitHybridForCausalLM:
    """Random float32 hybrid model with `flags`; channel OUTLIER of every residual norm's (1 + w) scale x30."""
    torch.manual_seed(seed)
    config = QuantkitHybridConfig(
        vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0, **TINY_HYBRID_SHAPE, **flags
    )
    model = QuantkitHybridForCausalLM(config)
    randomize_parameters(model, 0.05, HYBRID_RANDOM_PARAMETER_RULES)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[OUTLIER] = 30 * (1 + norm.weight[OUTLIER]) - 1
    return model.eval()


@pytest.mark.parametrize("case", list(FLAG_CASES))
def test_smoothing_preserves_function_every_flag(case):
    flags = FLAG_CASES[case]
    model = tiny_hybrid(flags)
    held_out = tokens(4, 32, seed=2)
    reference = logits(model, held_out)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    include_v_o = v_o_valid(flags)
    if not include_v_o:  # V-scale / head-wise RMSNorm are not homogeneous per channel in v: refused, model untouched
        with pytest.raises(SmoothQuantMappingError, match="v_proj -> o_proj smoothing is not function-preserving"):
            smooth_model(model, tokens(8, 32), include_v_o=True, progress=False)

    report = smooth_model(model, tokens(8, 32), include_v_o=include_v_o, include_up_down=True, progress=False)

    change = relative_change(logits(model, held_out), reference)
    assert change < 1e-4 and report.relative_logit_change < 1e-4, change
    by_smooth = {m.smooth: m for m in report.mappings}
    assert ("model.layers.3.self_attn.v_proj" in by_smooth) == include_v_o
    attn = by_smooth["model.layers.3.input_layernorm"]
    assert ("model.layers.3.self_attn.g_proj" in attn.consumers) == (flags.get("attn_output_gate") == "headwise")
    moe = by_smooth["model.layers.1.post_attention_layernorm"]
    assert moe.act_max_after < moe.act_max_before / 2  # the outlier migrated into the weights
    assert report.scales["model.layers.1.post_attention_layernorm"].argmax() == OUTLIER
    params = dict(model.named_parameters())
    for name, old in before.items():
        if name.endswith("pre_scale"):  # PreAffine: the fold divides (1 + w), lambda_1 stays
            assert torch.equal(params[name], old), name
        if name.endswith("gate_down.weight"):  # GatedNorm: gate_down columns x s (gate value unchanged)
            assert torch.equal(params[name], old) == name.startswith("model.norm."), name  # final norm: not smoothed


def test_gated_norm_fold_needs_the_gate_columns():
    """Control: the same factors folded without GatedNorm's gate_down columns change the function."""
    flags = FLAG_CASES["ga_gatednorm_r16"]
    held_out = tokens(4, 32, seed=2)
    report = smooth_model(tiny_hybrid(flags), tokens(8, 32), progress=False)
    control = tiny_hybrid(flags)
    reference = logits(control, held_out)
    for m in resolve_mappings(control).mappings:
        s = report.scales[m.smooth]
        norm = control.get_submodule(m.smooth)
        assert isinstance(norm, QuantkitHybridNorm)
        fold_offset_rmsnorm(norm, s, fold_gate=False)
        for c in m.consumers:
            scale_(input_weight(control.get_submodule(c)), s)
    assert relative_change(logits(control, held_out), reference) > 1e-2


@pytest.mark.parametrize("case", list(FLAG_CASES))
def test_routing_unchanged_by_smoothing_every_flag(case):
    changed = routing_change_after_smoothing(
        lambda: tiny_hybrid(FLAG_CASES[case]), TINY_HYBRID_SHAPE["num_experts_per_tok"]
    )
    assert min(changed) > 0.1, changed


def test_missing_g_proj_fold_is_caught(monkeypatch):
    """Head-wise GA: a mapping table that forgets to fold g_proj (lists it as a linear no norm feeds) fails
    smooth_model's own check and is rolled back."""
    from quantkit.calibrate import mappings as mappings_module

    model = tiny_hybrid(FLAG_CASES["ga_headwise"])
    attention = mappings_module.SOFTMAX_ATTENTION
    forgetful = dataclasses.replace(
        attention,
        norm=dataclasses.replace(
            attention.norm, consumers=tuple(c for c in attention.norm.consumers if "g_proj" not in c)
        ),
        unsmoothed=attention.unsmoothed + ("self_attn.g_proj?",),
    )
    hybrid = mappings_module.HYBRID
    family = dataclasses.replace(hybrid, slots=((mappings_module.GATED_DELTANET, forgetful), hybrid.slots[1]))
    monkeypatch.setitem(mappings_module.ARCHITECTURES, type(model).__name__, family)
    with pytest.raises(FunctionPreservationError):
        smooth_model(model, tokens(8, 32), progress=False)


# --------------------------------------------------------------------------------------- checkpoints


def tiny_calibration(recipe_name: str):
    """The recipe with calibration cut to 2 x 16 tokens (module docstring)."""
    recipe = load_recipe(recipe_name)
    if recipe.smoothquant is not None:
        recipe = dataclasses.replace(
            recipe, smoothquant=dataclasses.replace(recipe.smoothquant, num_sequences=2, seq_len=16)
        )
    if recipe.activation_scale == "static":
        recipe = dataclasses.replace(recipe, calibration=CalibrationSettings(num_sequences=2, seq_len=16))
    return recipe


@dataclasses.dataclass
class Source:
    path: Path
    model: QuantkitHybridForCausalLM  # as transformers reloads it, float32
    logits: torch.Tensor  # on PROBE


PROBE = tokens(2, 16, seed=3)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """One tiny hybrid checkpoint per flag case, with its reloaded model and logits (built on first use, shared
    by the recipes)."""
    built: dict[str, Source] = {}

    def get(case: str) -> Source:
        if case not in built:
            path = build_tiny_hybrid_checkpoint(tmp_path_factory.mktemp(case) / "m", **FLAG_CASES[case])
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            built[case] = Source(path, model, logits(model, PROBE))
        return built[case]

    return get


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("case", list(FLAG_CASES))
def test_every_recipe_every_flag_writes_a_checked_loadable_checkpoint(sources, tmp_path, case, recipe_name):
    source = sources(case)
    flags = FLAG_CASES[case]
    out = quantize_checkpoint(source.path, tiny_calibration(recipe_name), tmp_path / recipe_name)
    qc = check_servable(out)
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    source_state = source.model.state_dict()
    assert isinstance(source.model, QuantkitHybridForCausalLM)

    if recipe_name == "bf16":
        assert qc is None
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
        for name, value in source_state.items():
            assert torch.equal(reloaded[name], value.to(torch.bfloat16).float()), name
        return

    quantized, ignored = set(qc["quantized_modules"]), set(qc["ignored_modules"])
    assert len([n for n in quantized if EXPERT_MATRIX.match(n)]) == 4 * 8 * 3  # every routed expert matrix
    assert "model.layers.1.mlp.shared_expert_gate" in ignored and "model.layers.1.mlp.gate.weight" in keys
    assert ("model.layers.3.self_attn.g_proj" in quantized) == (flags.get("attn_output_gate") == "headwise")
    gates = {
        f"model.layers.{i}.{n}.{g}"
        for i in range(4)
        for n in ("input_layernorm", "post_attention_layernorm")
        for g in ("gate_down", "gate_up")
    }
    assert (gates <= ignored) == bool(flags.get("gated_norm_rank")) and not gates & quantized  # GatedNorm gates: BF16
    for extra in ("pre_scale", "v_scale_theta", "o_norm.weight"):  # flag parameters travel unquantized
        present = {k for k in keys if k.endswith(extra)}
        assert bool(present) == any(k.endswith(extra) for k in source_state), extra

    model = load_fake_quant_model(out)
    assert isinstance(model, QuantkitHybridForCausalLM)
    out_logits = logits(model, PROBE)
    assert torch.isfinite(out_logits).all() and not torch.equal(out_logits, source.logits)
