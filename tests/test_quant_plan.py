"""The quantization plan (`quantkit.quantize.plan`): a recipe resolved once against one model, read by both quantize
paths, the provenance record and the output config.

Exact assertions throughout: the plan is a pure function of the recipe and the model's config and matrix names (no
numerics), so every value below is determined, not measured.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from transformers import AutoConfig

from quantkit.calibrate.layers import skeleton_model
from quantkit.quantize import plan as plan_module
from quantkit.quantize.checkpoint import quantize_checkpoint
from quantkit.quantize.output import quantizable_weights
from quantkit.quantize.plan import QuantPlan, Windows, served_unit
from quantkit.quantize.provenance import calibration_sets, with_calibration
from quantkit.quantize.recipe import Backend, available_recipes, load_recipe


def _resolve(model_dir, recipe):
    config = AutoConfig.from_pretrained(model_dir)
    return QuantPlan.resolve(recipe, config, list(quantizable_weights(skeleton_model(config)))), config


def _own_recipes():
    """Every shipped recipe of quantkit's own backend whose schemes are fixed (a bit budget is chosen on a source)."""
    recipes = [load_recipe(name) for name in available_recipes()]
    return [r for r in recipes if r.backend == Backend.QUANTKIT and r.bit_budget is None]


def test_every_shipped_recipe_resolves_to_the_steps_it_names(tiny_checkpoint):
    """Per shipped recipe on the tiny model: the quantized matrices are those the recipe does not ignore, each with
    the recipe's scheme for it; the steps are present exactly when the recipe has their block; the calibration
    windows are those the provenance record lists (one rule, `calibration_windows_of`)."""
    for recipe in _own_recipes():
        plan, config = _resolve(tiny_checkpoint, recipe)
        names = list(quantizable_weights(skeleton_model(config)))
        expected = [n for n in names if not recipe.ignores(n)] if plan.scheme is not None else []
        assert plan.quantized == expected, recipe.name
        assert plan.ignored == [n for n in names if n not in expected], recipe.name
        assert all(plan.scheme_of(n) == recipe.scheme_of(n) for n in expected), recipe.name
        assert all(plan.scheme_of(n) is None for n in plan.ignored), recipe.name
        assert (plan.smoothquant is None) == (recipe.smoothquant is None), recipe.name
        assert (plan.gptq is None) == (recipe.gptq is None), recipe.name
        assert (plan.rotation is None) == (recipe.rotation is None), recipe.name
        assert (plan.static_scales is None) == (not recipe.static_activations), recipe.name
        records = [w.record() for w in plan.calibration_windows]
        assert records == calibration_sets(recipe, config.max_position_embeddings, config.model_type), recipe.name


def test_windows_are_cut_to_the_models_positions_where_the_step_cuts_them(tiny_checkpoint):
    """GPTQ's and the static scales' T is cut to max_position_embeddings (1024 here), the rotation check's is 128;
    SmoothQuant's T beyond the positions is refused at once, before any weight is read."""
    recipe = load_recipe("w4a4_nvfp4_sq_gptq")
    long = dataclasses.replace(recipe, gptq=dataclasses.replace(recipe.gptq, seq_len=4096))
    plan, config = _resolve(tiny_checkpoint, long)
    assert config.max_position_embeddings == 1024
    assert plan.gptq.windows == Windows("gptq", recipe.gptq.num_sequences, 1024, recipe.calibration_source("quantkit"))
    rotated, _ = _resolve(tiny_checkpoint, load_recipe("w4a4_nvfp4_rot"))
    assert (rotated.rotation.check.num_sequences, rotated.rotation.check.seq_len) == (2, 128)
    too_long = dataclasses.replace(recipe, smoothquant=dataclasses.replace(recipe.smoothquant, seq_len=2048))
    with pytest.raises(ValueError, match="seq_len=2048 exceeds the model's max_position_embeddings=1024"):
        _resolve(tiny_checkpoint, too_long)


def test_a_served_layer_split_across_schemes_is_refused_by_the_plan(tiny_checkpoint):
    """q/k/v (one vLLM layer) given two schemes: refused when the plan is resolved, naming the layer."""
    recipe = dataclasses.replace(load_recipe("w4a4_nvfp4"), module_schemes=((r"re:.*\.q_proj$", "fp8_block"),))
    with pytest.raises(ValueError, match=r"q_proj\+k_proj\+v_proj schemes \['fp8_block', 'nvfp4'\]"):
        _resolve(tiny_checkpoint, recipe)
    assert served_unit("model.layers.0.self_attn.v_proj") == "model.layers.0.self_attn.q_proj+k_proj+v_proj"


def test_the_output_config_is_the_plans(tiny_checkpoint, tmp_path):
    """config.json's quantization_config is `QuantPlan.quantization_config()` of the plan resolved on the source."""
    recipe = with_calibration(load_recipe("w4a4_nvfp4_sq"), 4, 32)
    out = quantize_checkpoint(tiny_checkpoint, recipe, tmp_path / "q", streaming=False)
    written = json.loads((out / "config.json").read_text())["quantization_config"]
    plan, _ = _resolve(tiny_checkpoint, recipe)
    assert written == json.loads(json.dumps(plan.quantization_config()))


@pytest.mark.parametrize("streaming", [False, True])
def test_quantize_resolves_the_plan_once(tiny_checkpoint, tmp_path, monkeypatch, streaming):
    """Both paths resolve the recipe into a plan exactly once (before any weight is read) and read it thereafter."""
    calls = []
    resolve = QuantPlan.resolve.__func__

    def counting(cls, *args, **kwargs):
        calls.append(args[0].name)
        return resolve(cls, *args, **kwargs)

    monkeypatch.setattr(plan_module.QuantPlan, "resolve", classmethod(counting))
    recipe = with_calibration(load_recipe("w4a4_nvfp4_sq_gptq"), 4, 32)
    quantize_checkpoint(tiny_checkpoint, recipe, tmp_path / "q", streaming=streaming)
    assert calls == [recipe.name]


def test_quantizing_twice_writes_the_same_bytes(tiny_checkpoint, tmp_path):
    """Every file of the whole-model checkpoint is the same bytes when the same recipe runs again: the header's
    metadata is one key (`SAFETENSORS_METADATA`), not a dict safetensors serializes in a per-process hash-map
    order. RTN encoding is elementwise on the same float32 weights, so the tensors are the same bits."""
    import hashlib

    def digest(path):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}

    first, second = (
        quantize_checkpoint(tiny_checkpoint, "w4a4_nvfp4", tmp_path / name, streaming=False) for name in ("a", "b")
    )
    assert digest(first) == digest(second)
