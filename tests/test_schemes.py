"""The scheme registry (quantkit.formats.schemes): each scheme's contract agrees with its own numerics.

Every test runs over every registered scheme, so a new scheme is checked by adding it to SCHEMES:
- encode writes exactly the contract's tensors (suffixes, safetensors dtypes, scale shapes), read back from a
  safetensors file as the checker reads them; decode gives the format's dequantization;
- its quantization_config passes `scheme_from_config`, and malformed ones are refused naming the key;
- the served (vLLM) layer layout, filled as the quant method's loader fills it, decodes to the same weight;
- the activation operands equal the kernels' quantizer (Triton interpreter), and fake-quant is their decoding.
"""

import pytest
import torch
from safetensors.torch import save_file

from quantkit.checkpoints import CheckpointError, tensor_headers
from quantkit.formats import (
    dequantize_fp8_block,
    dequantize_nvfp4,
    expand_block_scales,
    quantize_fp8_block,
    quantize_nvfp4_weight,
)
from quantkit.formats.schemes import (
    FP8_BLOCK,
    NVFP4,
    SCHEMES,
    UNQUANTIZED,
    get_scheme,
    scheme_for,
    scheme_from_config,
)
from quantkit.kernels.schemes import KERNELS

pytestmark = pytest.mark.cpu_isa  # run again with AVX2 kernels forced on AVX-512 CPUs (Makefile `test`)

N, K = 136, 200  # neither a multiple of 128 (partial FP8 blocks) nor K of 16 x 8 (NVFP4 padding: 208)
SCHEME_NAMES = list(SCHEMES)


def _weight(seed: int = 0, n: int = N, k: int = K) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_registry_names_and_bf16():
    assert SCHEME_NAMES == ["fp8_block", "nvfp4", "nvfp4_four_over_six"]
    assert all(SCHEMES[name].name == name for name in SCHEMES)
    assert scheme_for(UNQUANTIZED) is None and scheme_for("nvfp4") is NVFP4 and get_scheme("fp8_block") is FP8_BLOCK
    with pytest.raises(
        ValueError, match=r"unknown scheme 'int3'; expected one of \['fp8_block', 'nvfp4', 'nvfp4_four_over_six'\]"
    ):
        get_scheme("int3")
    assert set(KERNELS) == set(SCHEMES)  # every scheme can be served on CUDA


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_encode_writes_the_contract(name, tmp_path):
    scheme = SCHEMES[name]
    activation_scale = scheme.activation_scales[-1]
    tensors = scheme.encode(_weight(), "layer")
    if activation_scale == "static":
        tensors.update(scheme.static_activation_tensors(torch.tensor([3.0])))
    save_file({f"layer.{s}": t.contiguous() for s, t in tensors.items()}, str(tmp_path / "model.safetensors"))
    headers = tensor_headers(tmp_path)
    assert {n: dtype for n, (dtype, _) in headers.items()} == {
        f"layer.{s}": dtype for s, dtype in scheme.checkpoint_tensors(activation_scale).items()
    }
    assert scheme.shape_problem("layer", {n.split(".", 1)[1]: shape for n, (_, shape) in headers.items()}) is None
    assert scheme.marker in tensors


def test_decode_is_the_formats_dequantization():
    w = _weight()
    assert torch.equal(FP8_BLOCK.decode(FP8_BLOCK.encode(w, "w"), K), dequantize_fp8_block(*quantize_fp8_block(w)))
    assert torch.equal(NVFP4.decode(NVFP4.encode(w, "w"), K), dequantize_nvfp4(quantize_nvfp4_weight(w)))


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_shape_problems_are_named(name):
    scheme = SCHEMES[name]
    shapes = {s: tuple(t.shape) for s, t in scheme.encode(_weight(), "layer").items()}
    bad = dict(shapes, weight_scale=(shapes["weight_scale"][0], shapes["weight_scale"][1] - 1))
    assert "layer.weight_scale has shape" in scheme.shape_problem("layer", bad)
    if "weight" not in scheme.tensors:
        assert "also stores an unquantized layer.weight" in scheme.shape_problem("layer", dict(shapes, weight=(N, K)))


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_quantization_config_round_trip(name):
    scheme = SCHEMES[name]
    for activation_scale in scheme.activation_scales:
        qc = {**scheme.quantization_config(activation_scale), "quantized_modules": ["layer"]}
        assert scheme_from_config(qc) is scheme and qc["activation_scale"] == activation_scale
        assert set(qc) == {
            "format_version",
            "scheme",
            "weight_block_size",
            "group_size",
            "activation_scale",
            "quantized_modules",
        }
    assert scheme.quantization_config(None)["activation_scale"] == scheme.activation_scale(None)
    good = {**scheme.quantization_config(scheme.activation_scales[0]), "quantized_modules": ["layer"]}
    for edit, message in [
        ({"format_version": 2}, "format_version 2 is not supported"),
        ({"scheme": "int3"}, "scheme 'int3' is not one of"),
        ({"activation_scale": "per_tensor"}, "activation_scale 'per_tensor' is not valid"),
        ({"quantized_modules": []}, "quantized_modules is empty"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            scheme_from_config({**good, **edit})


def test_configs_written_for_each_scheme():
    assert FP8_BLOCK.quantization_config("static") == {
        "format_version": 1,
        "scheme": "fp8_block",
        "weight_block_size": [128, 128],
        "group_size": None,
        "activation_scale": "per_token",
    }
    assert NVFP4.quantization_config("static") == {
        "format_version": 1,
        "scheme": "nvfp4",
        "weight_block_size": None,
        "group_size": 16,
        "activation_scale": "static",
    }
    with pytest.raises(ValueError, match="no static activation scale"):
        FP8_BLOCK.static_activation_tensors(torch.tensor([1.0]))


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_served_layout_decodes_to_the_checkpoint_weight(name):
    """Two fused shards (136 and 40 rows: the second starts inside a 128-row block) loaded into the layer layout
    as quantkit.serve.quant_method's loader does decode to the shards' checkpoint weights, stacked."""
    scheme = SCHEMES[name]
    shards = [_weight(1), _weight(2, n=40)]
    n = sum(w.shape[0] for w in shards)
    encoded = [scheme.encode(w, f"shard{i}") for i, w in enumerate(shards)]
    params = {}
    for spec in scheme.layer_tensors(n, K, len(shards), "per_token"):
        parts = []
        for w, tensors in zip(shards, encoded):
            loaded = tensors[spec.suffix]
            if spec.per_shard == "rows":
                parts.append(loaded.reshape(()).expand(w.shape[0]))
            else:
                parts.append(expand_block_scales(loaded, (spec.rows_per_entry, 1))[: w.shape[0]])
        params[spec.suffix] = torch.cat(parts)
        assert tuple(params[spec.suffix].shape) == spec.shape and params[spec.suffix].dtype == spec.dtype
    want = torch.cat([scheme.decode(tensors, K) for tensors in encoded])
    assert torch.equal(scheme.decode_layer(params, K), want)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t  # FP8 compared bit for bit


@pytest.mark.parametrize(
    "name, static",
    [(n, s) for n in SCHEME_NAMES for s in (False, True) if not s or "static" in SCHEMES[n].activation_scales],
)
def test_activation_operands_equal_the_kernel_quantizer(name, static):
    scheme = SCHEMES[name]
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(4)) * torch.tensor([0.1, 1, 3, 30, 0])[:, None]
    input_global_scale = torch.tensor([0.004]) if static else None
    reference = scheme.quantize_activation(x, input_global_scale)
    fused = KERNELS[name].quantize(x, input_global_scale)
    assert len(reference) == len(fused)
    for want, got in zip(reference, fused):  # a static global scale: () in the reference, one a row in the kernel
        assert torch.equal(_bits(want).expand_as(got), _bits(got))


def test_row_amax_of_a_slice_gives_the_whole_rows_scales():
    """A tensor-parallel slice of K quantized with the whole row's amax equals that slice of the whole row's
    fake-quant, for every scheme; the row's own amax is the default."""
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    row_amax = x.abs().amax(-1, keepdim=True)
    for scheme in SCHEMES.values():
        whole = scheme.fake_quant_activation(x)
        assert torch.equal(scheme.fake_quant_activation(x, row_amax=row_amax), whole)
        assert torch.equal(scheme.fake_quant_activation(x[:, 128:], row_amax=row_amax), whole[:, 128:])


def test_expand_block_scales():
    scale = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    full = expand_block_scales(scale, (2, 3), (3, 4))
    assert torch.equal(full, torch.tensor([[1.0, 1, 1, 2], [1, 1, 1, 2], [3, 3, 3, 4]]))
    assert tuple(expand_block_scales(scale, (128, 1)).shape) == (256, 2)
