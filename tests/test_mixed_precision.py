"""Mixed precision by module (issue 31 item 3): a recipe's `module_schemes` assigns schemes by name pattern; the
checkpoint, its checker, the fake-quant reference, diagnose and (tests/test_serve_quantized.py, cases *-mixed)
vLLM honour it per module.

Asserted: each quantized module stores exactly its own scheme's tensors, bit for bit what that scheme's `encode`
gives for the source weight (no tolerance: the same functions on the same float32 weight); the whole-model and
streaming writers agree bit for bit; the reference builds each Linear / experts module with its own scheme; a split
of what vLLM serves as one layer (q/k/v, gate/up, one experts module) is refused by name, as are unknown schemes.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from quantkit.checkpoints import weight_files
from quantkit.formats.schemes import SCHEMES
from quantkit.models.tiny import build_tiny_stock_checkpoint
from quantkit.quantize.checkpoint import quantize_checkpoint
from quantkit.quantize.recipe import load_recipe, parse_recipe

RECIPE = "mixed_fp8_attn_nvfp4"


def state_of(model_dir) -> dict[str, torch.Tensor]:
    return {k: v for f in weight_files(model_dir) for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("architecture", ["llama", "qwen3_moe"])
def test_each_module_is_written_and_read_in_its_scheme(architecture, tmp_path):
    from quantkit.quantize.fake_quant import FakeQuantExperts, FakeQuantLinear, load_fake_quant_model
    from quantkit.serve.checkpoint_check import check_servable

    source = build_tiny_stock_checkpoint(tmp_path / architecture, architecture, seed=0)
    out = quantize_checkpoint(source, RECIPE, tmp_path / "q", streaming=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    attention = [m for m in qc["quantized_modules"] if ".self_attn." in m]
    assert attention and qc["scheme"] == "nvfp4" and qc["module_schemes"] == dict.fromkeys(attention, "fp8_block")
    check_servable(out)
    src, state = state_of(source), state_of(out)
    for module in qc["quantized_modules"]:
        scheme = SCHEMES[qc["module_schemes"].get(module, "nvfp4")]
        expected = scheme.encode(src[f"{module}.weight"].float(), module)
        stored = {k.removeprefix(f"{module}."): v for k, v in state.items() if k.startswith(f"{module}.")}
        assert set(stored) == set(expected) | ({"bias"} & set(stored)), module
        for suffix, tensor in expected.items():
            assert torch.equal(stored[suffix].view(torch.uint8), tensor.view(torch.uint8)), (module, suffix)
    streamed = quantize_checkpoint(source, RECIPE, tmp_path / "s", streaming=True)
    assert state_of(streamed).keys() == state.keys()
    assert all(torch.equal(v.view(torch.uint8), state[k].view(torch.uint8)) for k, v in state_of(streamed).items())

    model = load_fake_quant_model(out)
    schemes = {n: m.scheme.name for n, m in model.named_modules() if isinstance(m, FakeQuantLinear | FakeQuantExperts)}
    assert schemes and all(s == ("fp8_block" if ".self_attn." in n else "nvfp4") for n, s in schemes.items()), schemes
    if architecture == "qwen3_moe":
        assert any(n.endswith("mlp.experts") and s == "nvfp4" for n, s in schemes.items())


def test_diagnose_emulates_each_module_in_its_scheme(tmp_path):
    """diagnose's per-linear SNR of the mixed recipe is the FP8 recipe's on attention and NVFP4's elsewhere (the
    same emulation on the same inputs: equal floats)."""
    from quantkit.diagnose.run import diagnose

    source = build_tiny_stock_checkpoint(tmp_path / "llama", "llama", seed=0)
    r = diagnose(source, num_sequences=2, seq_len=16, recipes=[RECIPE, "w8a8_fp8_block", "w4a4_nvfp4"], progress=False)
    snr = r["quant_snr_db"]
    for name, value in snr[RECIPE].items():
        assert value == snr["w8a8_fp8_block" if ".self_attn." in name else "w4a4_nvfp4"][name], name


def test_splits_of_one_served_layer_and_bad_schemes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="module_schemes 'q_proj': scheme 'int4' is not one of"):
        parse_recipe({"name": "x", "scheme": "nvfp4", "module_schemes": [{"q_proj": "int4"}]})
    with pytest.raises(ValueError, match="module_schemes must be a list of one-entry mappings"):
        parse_recipe({"name": "x", "scheme": "nvfp4", "module_schemes": {"q_proj": "fp8_block"}})
    bf16_down = parse_recipe({"name": "x", "scheme": "nvfp4", "module_schemes": [{"down_proj": "bf16"}]})
    assert bf16_down.ignores("model.layers.0.mlp.down_proj") and not bf16_down.ignores("model.layers.0.mlp.up_proj")
    assert load_recipe(RECIPE).scheme_of("model.layers.0.linear_attn.in_proj_qkvz") == "fp8_block"

    source = build_tiny_stock_checkpoint(tmp_path / "llama", "llama", seed=0)
    split = tmp_path / "split.yaml"
    split.write_text('name: split\nscheme: nvfp4\nmodule_schemes:\n  - "q_proj": fp8_block\n')
    with pytest.raises(ValueError, match=r"self_attn\.q_proj\+k_proj\+v_proj schemes \['fp8_block', 'nvfp4'\]"):
        quantize_checkpoint(source, str(split), tmp_path / "q", streaming=False)
    moe = build_tiny_stock_checkpoint(tmp_path / "moe", "qwen3_moe", seed=0)
    split.write_text('name: split\nscheme: nvfp4\nmodule_schemes:\n  - "re:.*experts\\\\.0\\\\..*": fp8_block\n')
    with pytest.raises(ValueError, match=r"mlp\.experts schemes \['fp8_block', 'nvfp4'\]"):
        quantize_checkpoint(moe, str(split), tmp_path / "qm", streaming=False)
