"""Rotation (QuaRot; `quantkit.formats.hadamard`, `quantkit.quantize.rotation`, recipe key `rotation`; issue 31 item 2).

Asserted, with the reason each bound holds:
- Q = residual_rotation(n, seed) is orthogonal: QR in float64 is backward stable, so |Q Q^T - I| <= c n u64 (u64 =
  2**-53; c = 10 leaves room for the QR's constant), and the Kronecker factor with the scaled Hadamard matrix
  (entries +-2**-a/2, exact in float64 for even a, one rounding for odd a) adds one rounding per product.
- block_hadamard equals the dense product x (I (x) H_b) in float64 within the butterfly's rounding: log2(b) levels
  of float32 additions, each rounding relative u32 = 2**-24 of a partial sum bounded by the block's sum of |x|,
  plus one rounding for the input cast and one for the final scale: |err| <= (log2 b + 2) u32 sum|x_block| / sqrt b
  (the Wilkinson summation bound). Rows are transformed independently (elementwise operations only), so the
  result's bits do not depend on the leading shape: what lets the reference and every served path agree bit for
  bit.
- rotate_model preserves the function: its own check raises above TOLERANCE; here we also check that the model
  was in fact rotated (embedding = E Q exactly as computed in float64 and rounded once; every folded norm's weight
  is 1, or 0 for a (1 + w) norm), that tied embeddings were untied, and that the logits agree within TOLERANCE.
  A rotated hybrid's routed experts carry the online transform too: each expert's down_proj is listed, and the
  per-expert recomputation (`routed_expert_passes`: GPTQ's Hessians, diagnose) matches the module's output within
  diagnose's EXPERTS_CHECK_RTOL (the same float32 products summed in another order: (H + I + k) 2**-24 relative at
  worst, ~1e-5 at these widths; a recomputation without the transform is off by O(1)).
- Without a residual rotation (`residual: false`) on Gemma 3, which refuses a residual one (sandwich norms): every
  quantized Linear's weight is exactly block_hadamard(W, 16) of the float32 weight (the same function, so bit
  equality), the norms, embedding and head are untouched, the logits agree within TOLERANCE (the transform and its
  inverse in float32: a few u32 relative per matmul), both quantize paths write the same bytes (the same float32
  operations on the same tensors) and the fake-quant reference transforms each recorded input.
- SmoothQuant / AWQ before an input rotation: the search scores the product the rotated module serves (bit equality
  of the operands; the weights-only form within float32 summation) and both quantize paths write the same bytes.
- The checkpoint names each down_proj's block; the fake-quant reference applies the transform; the checker refuses
  a config naming an unquantized module; unsupported norms, architectures, streaming and an online transform on an
  unquantized down_proj are refused by name. vLLM parity: tests/test_serve_quantized.py cases *_rot.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from quantkit.diagnose.observe import EXPERTS_CHECK_RTOL
from quantkit.formats.experts import fused_experts_modules
from quantkit.formats.hadamard import block_hadamard, hadamard_matrix, online_block, residual_rotation
from quantkit.models.attention import load_reference_model
from quantkit.models.tiny import build_tiny_checkpoint, build_tiny_stock_checkpoint
from quantkit.models.tiny_hybrid import build_tiny_hybrid_checkpoint
from quantkit.quantize.checkpoint import quantize_checkpoint
from quantkit.quantize.recipe import parse_recipe
from quantkit.quantize.rotation import TOLERANCE, RotationError, rotate_model
from quantkit.quantize.routed_experts import routed_expert_passes

U32, U64 = 2.0**-24, 2.0**-53

pytestmark = pytest.mark.cpu_isa  # float32 forwards and folds: run again with AVX2 kernels forced (README, "Tests")


def quantize_both_paths(source, recipe, tmp_path):
    """Quantize `source` by the whole-model and the streaming path; assert they wrote the same tensors, bit for bit
    (the same float64 folds / float32 transforms rounded once, in the same order); the whole-model checkpoint."""
    from quantkit.checkpoints import read_state

    whole = quantize_checkpoint(source, recipe, tmp_path / "whole", streaming=False)
    streamed = quantize_checkpoint(source, recipe, tmp_path / "streamed", streaming=True)
    a, b = read_state(whole), read_state(streamed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return whole


@pytest.mark.parametrize("n", [64, 192, 576, 896])
def test_residual_rotation_is_orthogonal_seeded_and_mixes_every_channel(n):
    q = residual_rotation(n, seed=0)
    assert (q @ q.T - torch.eye(n, dtype=torch.float64)).abs().max() <= 10 * n * U64
    power = n & -n
    assert q.abs().max() <= 1 / math.sqrt(power) + U64  # |O_m| <= 1: an outlier channel is spread over all
    assert (q != 0).all()  # every channel into every other (Q's factors have no zero entry, almost surely)
    assert torch.equal(q, residual_rotation(n, seed=0)) and not torch.equal(q, residual_rotation(n, seed=1))


@pytest.mark.parametrize("n,block", [(64, 16), (576, 16), (896, 32)])
def test_block_residual_rotation_stays_within_its_groups(n, block):
    """rotation.block (MR-GPTQ): Q = diag(signs) (I (x) H_b) is orthogonal (entries +-1/sqrt(b), exact in float64
    for even log2 b, one rounding else: |Q Q^T - I| <= b u64), and channel i mixes only with the channels of its own
    run of b: an outlier reaches the quantization group it sits in (b = the group size), no other."""
    q = residual_rotation(n, seed=0, block=block)
    assert (q @ q.T - torch.eye(n, dtype=torch.float64)).abs().max() <= block * U64
    groups = torch.arange(n) // block
    assert ((q != 0) == (groups[:, None] == groups[None, :])).all()
    assert torch.allclose(q.abs()[q != 0], torch.full((), 1 / math.sqrt(block), dtype=torch.float64), rtol=0, atol=U64)
    assert torch.equal(q, residual_rotation(n, seed=0, block=block))
    assert not torch.equal(q, residual_rotation(n, seed=1, block=block))
    with pytest.raises(ValueError, match="power of two >= 2 dividing"):
        residual_rotation(n, seed=0, block=3 * n)


@pytest.mark.parametrize("k,block", [(1536, 512), (4864, 256), (208, 16)])
def test_block_hadamard_is_the_dense_product_within_the_butterflys_rounding(k, block):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, k, generator=gen) * torch.logspace(0, 3, k)[torch.randperm(k, generator=gen)]  # outliers
    assert online_block(k) == block
    ref = (x.double().view(6, k // block, block) @ hadamard_matrix(block)).view(6, k)
    y = block_hadamard(x, block)
    sums = x.double().abs().view(6, k // block, block).sum(-1, keepdim=True).expand(6, k // block, block)
    bound = (math.log2(block) + 2) * U32 * sums.reshape(6, k) / math.sqrt(block)
    assert y.dtype == torch.float32 and ((y.double() - ref).abs() <= bound).all()
    assert torch.equal(block_hadamard(x.view(2, 3, k), block).view(6, k), y)  # rows independent: bit-equal
    assert torch.equal(block_hadamard(x[3:], block), y[3:])
    with pytest.raises(ValueError, match="power of two dividing"):
        block_hadamard(x, 3)
    with pytest.raises(ValueError, match="power of two dividing"):
        block_hadamard(x, 2 * k)


MODELS = {
    "llama": lambda d: build_tiny_stock_checkpoint(d, "llama", seed=0),
    "qwen3": lambda d: build_tiny_stock_checkpoint(d, "qwen3", seed=0),
    "zoo_ga": lambda d: build_tiny_checkpoint(d, seed=0, attn_output_gate="headwise"),
    "hybrid": lambda d: build_tiny_hybrid_checkpoint(d, seed=0),  # Gated DeltaNet, MoE, (1 + w) norms
}


@pytest.mark.parametrize("name", list(MODELS))
def test_rotation_rotates_and_preserves_the_function(name, tmp_path):
    model = load_reference_model(MODELS[name](tmp_path / name), torch.float32)
    embed = model.get_input_embeddings().weight.detach().clone()
    model.get_output_embeddings().weight = model.get_input_embeddings().weight  # tie: rotation must untie
    model.config.tie_word_embeddings = True
    tokens = torch.randint(0, embed.shape[0], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(tokens).logits
    report = rotate_model(model, seed=3, online=True, verify_tokens=tokens)
    q = residual_rotation(embed.shape[1], 3)
    assert torch.equal(model.get_input_embeddings().weight, (embed.double() @ q).float())
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert model.config.tie_word_embeddings is False
    norms = [m for n, m in model.named_modules() if n.endswith(("input_layernorm", "post_attention_layernorm"))]
    offset = name == "hybrid"  # (1 + w) norms
    assert norms and all(torch.all(m.weight == (0.0 if offset else 1.0)) for m in norms)
    downs = [n for n, m in model.named_modules() if n.endswith("down_proj") and isinstance(m, torch.nn.Linear)]
    experts = fused_experts_modules(model)
    downs += [f"{n}.{e}.down_proj" for n, m in experts.items() for e in range(m.down_proj.shape[0])]
    assert (len(experts) > 0) == offset  # the hybrid's routed experts get the online transform too
    assert sorted(report.online_hadamard) == sorted(downs)
    for module in experts.values():  # per-expert recomputation (GPTQ's Hessians, diagnose) sees the transform too
        x = torch.randn(6, embed.shape[1], generator=torch.Generator().manual_seed(1))
        index = torch.randint(0, module.down_proj.shape[0], (6, 2), generator=torch.Generator().manual_seed(2))
        weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(3))
        recomputed = torch.zeros_like(x)
        for p in routed_expert_passes(module, x, index):
            recomputed.index_add_(0, p.token_idx, p.y * weights[p.token_idx, p.slot, None])
        out = module(x, index, weights)
        assert (recomputed - out).abs().max() <= EXPERTS_CHECK_RTOL * out.abs().max()  # diagnose's own check
    with torch.no_grad():
        after = model(tokens).logits
    assert (after - before).abs().max() <= TOLERANCE * before.abs().max()
    assert report.max_logit_change <= TOLERANCE * report.logit_scale


def test_block_rotation_preserves_the_function_and_both_paths_write_the_same_bytes(tmp_path):
    """`rotation: {block: 16}` on the tiny model (hidden 256): the residual Q is block-diagonal (the embedding is
    E Q of that Q), the online blocks default to 16, the logits stay within TOLERANCE, and the streaming and
    whole-model paths write the same bytes (the same float64 folds, rounded once)."""

    source = build_tiny_checkpoint(tmp_path / "tiny", seed=0)
    recipe = parse_recipe({"name": "rot16", "scheme": "nvfp4", "rotation": {"seed": 2, "block": 16}})
    model = load_reference_model(source, torch.float32)
    embed = model.get_input_embeddings().weight.detach().clone()
    tokens = torch.randint(0, embed.shape[0], (2, 24), generator=torch.Generator().manual_seed(0))
    report = rotate_model(model, 2, True, tokens, recipe.rotation.down_block, recipe.rotation.block)
    assert torch.equal(model.get_input_embeddings().weight, (embed.double() @ residual_rotation(256, 2, 16)).float())
    assert set(report.online_hadamard.values()) == {16} and report.to_dict()["residual_block"] == 16
    assert report.max_logit_change <= TOLERANCE * report.logit_scale
    whole = quantize_both_paths(source, recipe, tmp_path)
    config = json.loads((whole / "config.json").read_text())["quantization_config"]["rotation"]
    assert config["residual_block"] == 16 and set(config["online_hadamard"].values()) == {16}


@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_online_o_transforms_each_attention_output_and_both_paths_agree(family, tmp_path):
    """`rotation: {block: 16, online_o: true}`: besides the down_projs, every attention output projection (o_proj;
    the hybrid's Gated DeltaNet out_proj too) gets the online block Hadamard of 16, recorded per module; the logits
    stay within TOLERANCE (H_16 and its inverse in float32 on one more input per layer: a few u32 per matmul), both
    paths write the same tensors (the same float32 transforms), and the fake-quant reference applies the transform
    before o_proj's quantizer bit for bit (the same functions). vLLM runs an o_proj transform as it runs any
    recorded one (tests/test_serve_quantized.py, gemma3-nvfp4_had16, transforms every o_proj)."""
    from quantkit.quantize.fake_quant import FakeQuantLinear, load_fake_quant_model

    if family == "dense":
        source = build_tiny_checkpoint(tmp_path / "src", seed=0)
    else:
        source = build_tiny_hybrid_checkpoint(tmp_path / "src", seed=0)
    rotation = {"seed": 2, "block": 16, "online_o": True}
    recipe = parse_recipe({"name": "rot16o", "scheme": "nvfp4", "rotation": rotation})
    whole = quantize_both_paths(source, recipe, tmp_path)
    qc = json.loads((whole / "config.json").read_text())["quantization_config"]
    online, check = qc["rotation"]["online_hadamard"], qc["rotation"]
    assert check["max_logit_change"] <= TOLERANCE * check["logit_scale"]
    model = load_fake_quant_model(whole)
    outputs = [n for n, m in model.named_modules() if n.endswith(("self_attn.o_proj", "linear_attn.out_proj"))]
    assert outputs and all(online[n] == 16 for n in outputs)
    assert any(n.endswith("mlp.down_proj") or ".experts." in n for n in online)
    o_proj = next(m for n, m in model.named_modules() if n == outputs[0])
    assert isinstance(o_proj, FakeQuantLinear) and o_proj.online_hadamard == 16
    x = torch.randn(3, o_proj.weight.shape[1], generator=torch.Generator().manual_seed(0))
    expected = torch.nn.functional.linear(o_proj.scheme.fake_quant_activation(block_hadamard(x, 16)), o_proj.weight)
    assert torch.equal(o_proj(x), expected)
    from quantkit.pipelines.study import _rotation_label

    assert _rotation_label(recipe.rotation) == "+Rot16o"  # a study row of its own, apart from +Rot16
    for bad in ({"online_o": True, "residual": False}, {"online_o": True, "online": False}, {"online_o": 1}):
        with pytest.raises(ValueError, match="online_o"):
            parse_recipe({"name": "bad", "scheme": "nvfp4", "rotation": bad})


def test_a_rotated_checkpoint_records_and_applies_the_online_transform(tmp_path):
    from quantkit.checkpoints import CheckpointError
    from quantkit.formats.schemes import scheme_from_config
    from quantkit.quantize.fake_quant import FakeQuantLinear, load_fake_quant_model
    from quantkit.serve.checkpoint_check import check_servable

    source = build_tiny_stock_checkpoint(tmp_path / "llama", "llama", seed=0)
    out = quantize_checkpoint(source, "w4a4_nvfp4_rot", tmp_path / "q", streaming=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    online = qc["rotation"]["online_hadamard"]
    assert online == {f"model.layers.{i}.mlp.down_proj": 512 for i in range(2)}
    assert qc["rotation"]["max_logit_change"] <= TOLERANCE * qc["rotation"]["logit_scale"]
    check_servable(out)
    model = load_fake_quant_model(out)
    fakes = {n: m for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)}
    assert {n for n, m in fakes.items() if m.online_hadamard} == set(online)
    down = fakes["model.layers.0.mlp.down_proj"]
    x = torch.randn(3, down.weight.shape[1])
    expected = torch.nn.functional.linear(down.scheme.fake_quant_activation(block_hadamard(x, 512)), down.weight)
    assert torch.equal(down(x), expected)
    with pytest.raises(CheckpointError, match=r"rotation.online_hadamard names"):
        scheme_from_config({**qc, "rotation": {"online_hadamard": {"lm_head": 512}}})
    with pytest.raises(CheckpointError, match="not powers of two"):
        scheme_from_config({**qc, "rotation": {"online_hadamard": {"model.layers.0.mlp.down_proj": 24}}})


def test_a_rotated_hybrid_checkpoint_transforms_every_experts_down_input(tmp_path):
    """The routed experts' online Hadamard end to end on the reference side: recorded per expert down_proj (one block
    per experts module), applied by FakeQuantExperts before down_proj's quantizer (bit-exact: the same functions),
    refused when a config names only some experts or gives them different blocks. vLLM parity:
    tests/test_hybrid_serve_quantized.py, case stock-nvfp4_rot."""
    from quantkit.checkpoints import CheckpointError
    from quantkit.formats.schemes import scheme_from_config
    from quantkit.quantize.fake_quant import FakeQuantExperts, load_fake_quant_model

    source = build_tiny_hybrid_checkpoint(tmp_path / "hybrid", seed=0)
    out = quantize_checkpoint(source, "w4a4_nvfp4_rot", tmp_path / "q", streaming=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    online = qc["rotation"]["online_hadamard"]
    experts = {n: m for n, m in load_fake_quant_model(out).named_modules() if isinstance(m, FakeQuantExperts)}
    assert experts
    for name, module in experts.items():
        num, intermediate = module.down_proj.shape[0], module.down_proj.shape[2]
        assert {online[f"{name}.{e}.down_proj"] for e in range(num)} == {online_block(intermediate)}
        assert module.online_hadamard == online_block(intermediate)
        h = torch.randn(5, intermediate, generator=torch.Generator().manual_seed(0))
        expected = module.scheme.fake_quant_activation(block_hadamard(h, module.online_hadamard))
        assert torch.equal(module.fake_quant_input(h, 0, 1), expected)
    name = next(iter(experts))
    partial = {m: b for m, b in online.items() if m != f"{name}.1.down_proj"}
    with pytest.raises(CheckpointError, match=f"not {name}.1.down_proj"):
        scheme_from_config({**qc, "rotation": {"online_hadamard": partial}})
    with pytest.raises(CheckpointError, match="different blocks"):
        scheme_from_config({**qc, "rotation": {"online_hadamard": {**online, f"{name}.1.down_proj": 2}}})


def test_input_rotation_transforms_every_quantized_input_of_gemma3_and_both_paths_agree(tmp_path):

    from quantkit.quantize.fake_quant import FakeQuantLinear, load_fake_quant_model

    source = build_tiny_stock_checkpoint(tmp_path / "gemma3", "gemma3", seed=0)
    model = load_reference_model(source, torch.float32)
    tokens = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    refusal = r"Gemma3ForCausalLM takes no residual rotation: its sandwich norms.*residual: false"
    with pytest.raises(RotationError, match=refusal):
        rotate_model(model, 0, True, tokens)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.layers")]
    with torch.no_grad():
        logits = model(tokens).logits
    report = rotate_model(model, 0, True, tokens, block=16, residual=False, quantized=linears)
    assert report.online_hadamard == dict.fromkeys(linears, 16)
    assert report.to_dict()["residual"] is False and "residual_block" not in report.to_dict()
    after = model.state_dict()
    for key, value in after.items():
        module = key.rsplit(".", 1)[0]
        expected = block_hadamard(before[key], 16) if module in linears else before[key]
        assert torch.equal(value, expected), key
    with torch.no_grad():
        assert (model(tokens).logits - logits).abs().max() <= TOLERANCE * logits.abs().max()

    recipe = parse_recipe(
        {
            "name": "had16_gptq",
            "scheme": "nvfp4",
            "weight_scales": "mse",
            "rotation": {"block": 16, "residual": False},
            "gptq": {"num_sequences": 4, "seq_len": 64},
        }
    )
    whole = quantize_both_paths(source, recipe, tmp_path)
    qc = json.loads((whole / "config.json").read_text())["quantization_config"]
    assert qc["rotation"]["residual"] is False
    assert qc["rotation"]["online_hadamard"] == dict.fromkeys(linears, 16)
    fakes = {n: m for n, m in load_fake_quant_model(whole).named_modules() if isinstance(m, FakeQuantLinear)}
    assert {n for n, m in fakes.items() if m.online_hadamard == 16} == set(linears)
    q = fakes[linears[0]]
    x = torch.randn(3, q.weight.shape[1])
    expected = torch.nn.functional.linear(q.scheme.fake_quant_activation(block_hadamard(x, 16)), q.weight)
    assert torch.equal(q(x), expected)


def test_what_rotation_cannot_do_is_refused_by_name(tmp_path):
    tokens = torch.randint(0, 500, (1, 8))
    for flags, what in [(dict(pre_affine=True), "pre_scale"), (dict(gated_norm_rank=8), "gate_down")]:
        model = load_reference_model(build_tiny_checkpoint(tmp_path / what, seed=0, **flags), torch.float32)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(RotationError, match=what):
            rotate_model(model, 0, True, tokens)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # refused before any change
    mixtral = load_reference_model(build_tiny_stock_checkpoint(tmp_path / "mixtral", "mixtral", seed=0), torch.float32)
    with pytest.raises(RotationError, match="MixtralForCausalLM is not a registered decoder"):
        rotate_model(mixtral, 0, True, tokens)
    llama = load_reference_model(build_tiny_stock_checkpoint(tmp_path / "llama", "llama", seed=0), torch.float32)
    with pytest.raises(RotationError, match="online_block 1024 does not divide"):
        rotate_model(llama, 0, True, tokens, block=1024)

    source = tmp_path / "llama"
    with pytest.raises(RotationError, match="pre_scale"):  # streaming: refused on the skeleton, nothing written
        quantize_checkpoint(tmp_path / "pre_scale", "w4a4_nvfp4_rot", tmp_path / "s", streaming=True)
    assert not (tmp_path / "s").exists()
    bf16_down = parse_recipe(
        {"name": "x", "scheme": "nvfp4", "rotation": {}, "module_schemes": [{"down_proj": "bf16"}]}
    )
    with pytest.raises(ValueError, match=r"online Hadamard needs model.layers.0.mlp.down_proj quantized"):
        quantize_checkpoint(source, bf16_down, tmp_path / "b", streaming=False)
    for bad, message in [
        ({"seed": -1}, "rotation.seed must be an integer >= 0"),
        ({"online": "yes"}, "rotation.online must be true or false"),
        ({"online_block": 24}, "rotation.online_block must be a power of two"),
        ({"angle": 3}, "rotation must be a mapping with keys"),
        ({"residual": "no"}, "rotation.residual must be true or false"),
        ({"residual": False, "online": False}, "rotation.residual false with online false rotates nothing"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_recipe({"name": "x", "scheme": "nvfp4", "rotation": bad})
    with pytest.raises(ValueError, match="rotation applies to quantkit's own quantized schemes only"):
        parse_recipe({"name": "x", "scheme": "bf16", "rotation": {}})
    up_down = {"name": "x", "scheme": "nvfp4", "smoothquant": {"include_up_down": True}}
    with pytest.raises(ValueError, match=r"include_up_down does not compose with rotation.online"):
        parse_recipe({**up_down, "rotation": {"online": True}})
    assert parse_recipe({**up_down, "rotation": {"online": False}}).rotation is not None  # no transform between them
    # an input rotation comes after the smoothing: every mapping folds before its transform
    assert parse_recipe({**up_down, "rotation": {"residual": False}}).rotation.after_smoothing
    # a searched smoothing (AWQ) after a residual rotation: measured on the rotated model, whose searched consumers
    # (q/k/v, gate/up) have no online transform (v -> o with online_o: refused, tests/test_alpha_search.py)
    awq = {"name": "x", "scheme": "nvfp4", "smoothquant": {"scales": "awq"}}
    assert not parse_recipe({**awq, "rotation": {"online": True}}).rotation.after_smoothing


def test_quality_reads_a_rotated_tied_checkpoint_as_the_whole_models_do(tmp_path):
    """`quality` on a rotated checkpoint of a tied-embedding model: the quantized stream starts from the checkpoint's
    own rotated embeddings and ends at its untied head, so its layer-by-layer KL equals the whole models' (source vs
    `load_fake_quant_model`). Bound as tests/test_quantize_checkpoint.py::test_layerwise_quality_equals_the_whole_models
    derives it: |dKL| <= 2 delta (1 + max|log p - log q|), delta = (4L + 1) K u max|logit| (float32 summation order
    of batches of different size). Every quantized layer has an SNR, with or without a residual rotation
    (`w4a4_nvfp4_had16`: none; each layer reads the reference's input and transforms it itself)."""
    from safetensors.torch import load_file, save_file
    from test_quantize_checkpoint import whole_model_kl
    from transformers import AutoTokenizer

    from quantkit.data import heldout_windows
    from quantkit.quantize.fake_quant import load_fake_quant_model
    from quantkit.quantize.quality import quality

    source = build_tiny_stock_checkpoint(tmp_path / "llama", "llama", seed=0)
    state = load_file(str(source / "model.safetensors"))
    del state["lm_head.weight"]  # tied: the embedding is the head
    save_file(state, str(source / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    out = quantize_checkpoint(source, "w4a4_nvfp4_rot", tmp_path / "q", streaming=False)
    assert "lm_head.weight" in load_file(str(out / "model.safetensors"))  # untied by the rotation
    tokens = heldout_windows(AutoTokenizer.from_pretrained(source), 10, 64)
    layerwise = quality(source, out, tokens)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert set(layerwise["layer_snr_db"]) == set(qc["quantized_modules"])  # measured on the rotated reference

    per_window, bound = whole_model_kl(load_reference_model(source, torch.float32), load_fake_quant_model(out), tokens)
    whole_kl = per_window.mean().item()
    assert abs(layerwise["kl"] - whole_kl) <= bound, (layerwise["kl"], whole_kl, bound)
    assert bound < layerwise["kl"] / 2

    # no residual rotation: the tie is kept, each layer reads the reference's input (transformed inside): SNR too
    had = quantize_checkpoint(source, "w4a4_nvfp4_had16", tmp_path / "had", streaming=False)
    assert "lm_head.weight" not in load_file(str(had / "model.safetensors"))
    layerwise = quality(source, had, tokens)
    qc = json.loads((had / "config.json").read_text())["quantization_config"]
    assert set(layerwise["layer_snr_db"]) == set(qc["quantized_modules"]) == set(qc["rotation"]["online_hadamard"])
    per_window, bound = whole_model_kl(load_reference_model(source, torch.float32), load_fake_quant_model(had), tokens)
    assert abs(layerwise["kl"] - per_window.mean().item()) <= bound


def test_quality_of_a_rotated_checkpoint_is_that_of_the_same_weights_quantized_from_the_rotated_source(tmp_path):
    """`quality` measures a residual-rotated checkpoint's layers on the source rotated as the checkpoint records
    (seed, residual block). Bit equality, derived: quantizing the source with a residual rotation (no online
    transform) and quantizing the source pre-rotated by rotate_model (saved in float32) with the same recipe minus
    the rotation run the same float64 rotations rounded once to float32 and the same encoder, so the two checkpoints
    hold the same bytes; quality's reference is rotated layer by layer by the same functions, so every layer SNR
    and the KL are the same floats. A reference left unrotated (or rotated with another seed) would give layers
    an input their weights were not made for: SNRs near 0 dB instead of the quantization noise's."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from quantkit.data import heldout_windows
    from quantkit.quantize.quality import quality

    source = build_tiny_stock_checkpoint(tmp_path / "llama", "llama", seed=0)
    settings = {"name": "rot16_rtn", "scheme": "nvfp4", "activation_scale": "per_token"}
    rotated_recipe = parse_recipe({**settings, "rotation": {"seed": 3, "block": 16, "online": False}})
    rotated_ckpt = quantize_checkpoint(source, rotated_recipe, tmp_path / "rotated-q", streaming=False)

    model = load_reference_model(source, torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    rotate_model(model, 3, False, heldout_windows(tokenizer, 2, 32), residual_block=16)
    model.save_pretrained(tmp_path / "pre-rotated")
    tokenizer.save_pretrained(tmp_path / "pre-rotated")
    plain_ckpt = quantize_checkpoint(tmp_path / "pre-rotated", parse_recipe(settings), tmp_path / "plain-q")

    a, b = load_file(str(rotated_ckpt / "model.safetensors")), load_file(str(plain_ckpt / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the same weights, bit for bit
    tokens = heldout_windows(tokenizer, 10, 64)
    measured = quality(source, rotated_ckpt, tokens)
    expected = quality(tmp_path / "pre-rotated", plain_ckpt, tokens)
    assert measured["layer_snr_db"] == expected["layer_snr_db"] and measured["kl"] == expected["kl"]
    assert len(measured["layer_snr_db"]) == 7 * model.config.num_hidden_layers


def test_quality_hands_a_layer_with_an_online_hadamard_its_input_before_the_transform():
    """The SNR hooks of `quality` give the fake-quant layer the reference layer's input before its forward
    pre-hooks: on a rotated reference, a down_proj folded W (I (x) H_b) with the online pre-hook, and a "quantized"
    layer computing the same float32 operations from the untransformed input (the transform, then the same
    product), the noise is exactly 0 (the same floats in the same order). Handing it the transformed input would
    apply the transform twice: an O(1) noise."""
    from torch import nn

    from quantkit.quantize.quality import _snr_hooks
    from quantkit.quantize.rotation import _online_hook

    torch.manual_seed(0)
    folded = block_hadamard(torch.randn(8, 32), 16)
    reference, quantized = nn.Sequential(nn.Linear(32, 8, bias=False)), nn.Sequential(nn.Linear(32, 8, bias=False))
    for model in (reference, quantized):
        model[0].weight.data.copy_(folded)
    reference[0].register_forward_pre_hook(_online_hook(16))
    quantized[0].register_forward_pre_hook(_online_hook(16))  # the fake-quant layer transforms its input itself
    signal, noise = {}, {}
    with torch.no_grad(), _snr_hooks(reference, quantized, ["0"], {"0"}, signal, noise):
        reference(torch.randn(5, 32))
    assert signal["0"] > 0 and noise["0"] == 0.0


def test_a_search_before_an_input_rotation_scores_what_the_rotated_module_serves(tmp_path):
    """`search_through_online` against the module `rotate_model` (residual false) leaves: that module holds W H
    (H = I (x) H_16) and its pre-hook hands x H to the layer. The through-product of (x, W) is the recipe's product
    of exactly those operands (block_hadamard is the one function both call, so bit equality); x times the
    through-weight of W is x H Q(W H)^T, the rotated module's weights-only output, within float32 summation: the
    same real product summed in two orders: the K-term dot products (K roundings of u32 relative to |x| |W|, the
    Wilkinson bound) and H_16's log2 16 = 4 butterfly levels on each side (the 1/4 scale is exact), each level
    rounding to u32 of its output, which is at most |x| |H| in magnitude; K + 8 roundings against both operand
    magnitudes covers it with room to spare; a search without the transform scores another product."""
    from quantkit.calibrate.alpha_search import AlphaSearch
    from quantkit.quantize.fake_quant import quantized_product, quantized_weight
    from quantkit.quantize.rotation import search_through_online

    source = build_tiny_stock_checkpoint(tmp_path / "llama", "llama", seed=0)
    model = load_reference_model(source, torch.float32)
    name = "model.layers.0.self_attn.q_proj"
    linear = model.get_submodule(name)
    w = linear.weight.detach().clone()
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.layers")]
    tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    report = rotate_model(model, 0, True, tokens, block=16, residual=False, quantized=linears)
    seen = {}
    linear.register_forward_pre_hook(lambda module, args: seen.update(x=args[0]))  # returns None: input unchanged
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(1))
    linear(x)
    recipe = parse_recipe({"name": "had16_awq", "scheme": "nvfp4", "rotation": {"block": 16, "residual": False}})
    plain = AlphaSearch(quantized_product(recipe), weight=quantized_weight(recipe))
    through = search_through_online(plain, report.online_hadamard)
    served = plain.product(name, seen["x"], linear.weight.detach())
    assert torch.equal(through.product(name, x, w), served)
    assert not torch.equal(plain.product(name, x, w), served)
    decoded = through.weight(name, w)  # unrotated coordinates
    rotated = quantized_weight(recipe)(name, linear.weight.detach())
    exact = (seen["x"].double() @ rotated.double().T).float()
    bound = (w.shape[1] + 4 + 4) * U32 * (x.abs() @ decoded.abs().T + seen["x"].abs() @ rotated.abs().T)
    assert ((x @ decoded.T) - exact).abs().le(bound).all()
    assert not torch.allclose(x @ plain.weight(name, w).T, exact, atol=0, rtol=1e-3)


def test_awq_before_an_input_rotation_folds_first_and_both_paths_write_the_same_bytes(tmp_path):
    """AWQ with every mapping (v -> o and up -> down too) and MR-GPTQ's input rotation (`residual: false`, block 16):
    the smoothing is searched through the transforms and folded first, then each quantized input is rotated; both
    checks (SmoothQuant's and the rotation's, each raising above its tolerance) pass inside quantize, both paths
    write the same bytes and record the same search errors (the streaming search is the through-rotation one too:
    the same float32 operations on the same batches), the checkpoint records every Linear's block, and every
    mapping's recorded errors differ from those of the same search without the rotation (it scores the rotated
    products: a different quantization of each candidate, so different float32 sums)."""
    source = build_tiny_stock_checkpoint(tmp_path / "llama", "llama", seed=0)
    awq = {"scales": "awq", "include_v_o": True, "include_up_down": True, "num_sequences": 8, "seq_len": 32}
    base = {"name": "had16_awq", "scheme": "nvfp4", "weight_scales": "mse", "smoothquant": awq}
    recipe = parse_recipe(
        {**base, "rotation": {"block": 16, "residual": False}, "gptq": {"num_sequences": 4, "seq_len": 32}}
    )
    whole = quantize_both_paths(source, recipe, tmp_path)
    qc = json.loads((whole / "config.json").read_text())["quantization_config"]
    assert qc["rotation"]["residual"] is False and set(qc["rotation"]["online_hadamard"].values()) == {16}
    report = json.loads((whole / "smoothquant.json").read_text())
    streamed = json.loads((tmp_path / "streamed" / "smoothquant.json").read_text())
    assert streamed["alpha_errors"] == report["alpha_errors"]
    names = {m["name"] for m in report["mappings"]}
    assert any(n.endswith("v_proj -> o_proj") for n in names) and any(n.endswith("up_proj -> down_proj") for n in names)
    unrotated = quantize_checkpoint(source, parse_recipe({**base, "name": "awq"}), tmp_path / "awq", streaming=False)
    plain = json.loads((unrotated / "smoothquant.json").read_text())["alpha_errors"]
    assert set(plain) == set(report["alpha_errors"]) == names
    assert all(report["alpha_errors"][n] != plain[n] for n in names)
