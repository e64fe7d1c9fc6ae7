"""Recipes in configs/recipes load, validate and name their problems."""

import pytest

from quantkit.quantize.recipe import DEFAULT_IGNORE, available_recipes, load_recipe, parse_recipe

PEER = {"name": "x", "scheme": "NVFP4", "backend": "llmcompressor"}
REQUIRED = {"bf16", "w8a8_fp8_block", "w8a8_fp8_block_sq", "w4a4_nvfp4", "w4a4_nvfp4_sq", "fp8_block_ct", "nvfp4_ct"}


def test_every_shipped_recipe_loads():
    assert set(available_recipes()) >= REQUIRED
    for name in available_recipes():
        recipe = load_recipe(name)
        assert recipe.name == name and recipe.ignore[: len(DEFAULT_IGNORE)] == DEFAULT_IGNORE
    assert load_recipe("w4a4_nvfp4").activation_scale == "per_token"
    assert load_recipe("w4a4_nvfp4_static").activation_scale == "static"
    assert load_recipe("w8a8_fp8_block_sq").smoothquant.alpha == 0.5
    assert load_recipe("nvfp4_ct").backend == "llmcompressor"
    assert load_recipe("nvfp4_modelopt").backend == "modelopt"


def test_ignore_list():
    recipe = parse_recipe({"name": "x", "scheme": "nvfp4", "ignore": [r"re:.*\.g_proj$", "o_proj"]})
    assert recipe.ignores("lm_head")
    assert recipe.ignores("model.layers.3.post_attention_layernorm.gate_up")
    assert recipe.ignores("model.layers.0.self_attn.g_proj")
    assert recipe.ignores("model.layers.0.self_attn.o_proj")
    assert not recipe.ignores("model.layers.0.mlp.up_proj")
    assert not recipe.ignores("model.layers.0.self_attn.g_proj_extra")


@pytest.mark.parametrize(
    "data, message",
    [
        ({"name": "x"}, "missing required key 'scheme'"),
        ({"name": "x", "scheme": "int4"}, "scheme 'int4' is not one of"),
        ({"name": "x", "scheme": "nvfp4", "backend": "gptq"}, "backend 'gptq'"),
        ({"name": "x", "scheme": "NVFP4"}, "for backend 'quantkit'"),
        ({"name": "x", "scheme": "fp8_block", "activation_scale": "static"}, "nvfp4 only"),
        ({"name": "x", "scheme": "nvfp4", "activation_scale": "per_group"}, "activation_scale 'per_group'"),
        ({"name": "x", "scheme": "nvfp4", "smoothquant": {"alpha": 1.5}}, "alpha must be in"),
        ({"name": "x", "scheme": "nvfp4", "smoothquant": {"beta": 1}}, "unknown key"),
        ({"name": "x", "scheme": "nvfp4", "smoothquant": {"num_sequences": 0}}, "positive integer"),
        ({"name": "x", "scheme": "nvfp4", "ignore": ["re:(("]}, "not a valid regex"),
        ({"name": "x", "scheme": "nvfp4", "weights": "int4"}, "unknown recipe key"),
        ({"name": "x", "scheme": "NVFP4", "backend": "modelopt", "smoothquant": {}}, "backend quantkit only"),
        ({"name": "x", "scheme": "FP8_BLOCK", "backend": "modelopt"}, "for backend 'modelopt'"),
        # the peers' own transform modifiers (issue 51 item 5): named, with arguments the registry lists
        ({**PEER, "backend": "modelopt", "peer_modifiers": {"AWQModifier": {}}}, r"not one of .*'modelopt'"),
        ({"name": "x", "scheme": "nvfp4", "peer_modifiers": {"awq_lite": {}}}, "llmcompressor, modelopt only"),
        ({**PEER, "backend": "modelopt", "peer_modifiers": {"awq_lite": {}, "mse": {}}}, "one calibration algorithm"),
        ({**PEER, "backend": "modelopt", "peer_modifiers": {"mse": {"alpha_step": 0.1}}}, "keys among"),
        ({**PEER, "peer_modifiers": {"QuIPModifier": {}}}, "not one of"),
        ({**PEER, "peer_modifiers": {"AWQModifier": {"mappings": []}}}, "keys among"),
        ({**PEER, "peer_modifiers": {"AWQModifier": {"n_grid": 0}}}, "n_grid must be"),
        ({**PEER, "peer_modifiers": {"AWQModifier": {"duo_scaling": "half"}}}, "duo_scaling must be"),
        ({**PEER, "peer_modifiers": {"SpinQuantModifier": {"rotations": ["R1", "R4"]}}}, "R3 and R4 are online"),
        ({**PEER, "peer_modifiers": {"SpinQuantModifier": {"transform_block_size": 12}}}, "power of two"),
        ({**PEER, "peer_modifiers": {"SpinQuantModifier": {"transform_type": "random-matrix"}}}, "transform_type"),
        ({**PEER, "peer_modifiers": []}, "must be a mapping"),
    ],
)
def test_bad_recipes_name_the_problem(data, message):
    with pytest.raises(ValueError, match=message):
        parse_recipe(data)


def test_peer_modifiers_keep_their_order_and_share_one_calibration_set():
    """A peer's transform modifiers run in the recipe's order; every step of the peer that reads data (its AWQ, its
    GPTQ, its static scales) reads one set, named by those uses; SpinQuant's rotations read none."""
    from quantkit.quantize.plan import calibration_windows_of

    awq = load_recipe("nvfp4_ct_awq")
    assert awq.peer_modifiers == (("AWQModifier", (("duo_scaling", True), ("n_grid", 20))),)
    assert [w.use for w in calibration_windows_of(awq)] == ["awq and activation scales"]
    spin = load_recipe("nvfp4_ct_spinquant16_gptq")
    assert [name for name, _ in spin.peer_modifiers] == ["SpinQuantModifier"]
    assert [w.use for w in calibration_windows_of(spin)] == ["gptq and activation scales"]
    both = parse_recipe({**PEER, "peer_modifiers": {"SpinQuantModifier": None, "AWQModifier": {"n_grid": 4}}})
    assert [name for name, _ in both.peer_modifiers] == ["SpinQuantModifier", "AWQModifier"]
    fp8 = parse_recipe({**PEER, "scheme": "FP8_BLOCK", "peer_modifiers": {"AWQModifier": {}}})
    assert [(w.use, w.num_sequences) for w in calibration_windows_of(fp8)] == [("awq", 64)]  # dynamic activations
    assert calibration_windows_of(parse_recipe({**PEER, "scheme": "FP8_BLOCK"})) == ()


def test_modelopt_recipes_name_its_calibration_algorithm():
    """ModelOpt's AWQ-lite and MSE rows: the algorithm and its arguments reach ModelOpt's config as its "algorithm"
    (the preset's quantizers unchanged), one calibration set named by its use; the plain preset keeps "max"."""
    import modelopt.torch.quantization as mtq
    from torch import nn

    from quantkit.quantize.modelopt_backend import modelopt_config
    from quantkit.quantize.plan import calibration_windows_of

    awq, mse = load_recipe("nvfp4_modelopt_awq"), load_recipe("nvfp4_modelopt_mse")
    assert [w.use for w in calibration_windows_of(awq)] == ["awq and activation scales"]
    assert [w.use for w in calibration_windows_of(mse)] == ["mse and activation scales"]
    model = nn.Sequential(nn.Linear(32, 32))
    config = modelopt_config(awq, model)
    assert config["algorithm"] == {"method": "awq_lite", "alpha_step": 0.1}
    assert config["quant_cfg"] == mtq.NVFP4_AWQ_LITE_CFG["quant_cfg"] == mtq.NVFP4_DEFAULT_CFG["quant_cfg"]
    assert modelopt_config(mse, model)["algorithm"] == {"method": "mse"}
    assert modelopt_config(load_recipe("nvfp4_modelopt"), model)["algorithm"] == "max"


def test_unknown_recipe_name_lists_the_available_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown recipe 'w3a3'.*w4a4_nvfp4"):
        load_recipe("w3a3")
    bad = tmp_path / "mine.yaml"
    bad.write_text("name: other\nscheme: bf16\n")
    with pytest.raises(ValueError, match="differs from the file name"):
        load_recipe(bad)
