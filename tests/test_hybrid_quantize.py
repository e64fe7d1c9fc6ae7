"""SmoothQuant and quantized checkpoints for the hybrid MoE (stock transformers Qwen3NextForCausalLM).

The model: a tiny random Qwen3-Next built locally (4 layers = 3 Gated DeltaNet + 1 gated softmax attention,
hidden 128, 8 routed experts top-2 + a shared expert, head_dim 64, linear key/value head dim 64; the shape
vLLM's CPU Gated DeltaNet accepts), float32. moe_intermediate_size 96 is deliberately not a multiple of 128
(partial FP8 blocks) and the 3-D experts are fused in transformers 5.x (`quantkit.formats.experts`).

Tolerances (derived, not fitted):
- Function preservation in float32: the folds are exact in real arithmetic. Each folded parameter is rounded
  once (<= u = 2**-24 relative); the (1+w) norm fold w' = (1+w)/s - 1 is rounded twice and re-added to 1 in
  the forward, an absolute error <= 2u max(1, |w'|) on the effective scale (1+w)/s, i.e. <= 2u s/(1+w) relative:
  <= ~50u here (s <= ~20 with the x30 outlier, 1+w ~ 1). The forward then rounds differently, ~ lambda sqrt(K) u
  per dot product (K <= 256), through 4 layers and the chunked delta rule (cumulative decays, <= 64 steps):
  O(1e-6 .. 1e-5) of the logits' max, so `relative change < 1e-4` holds on any ISA, while a single missing fold
  (router, shared-expert gate) moves them by > 1e-2 (the controls below).
- Routing: with float32 folds, router logits move by ~1e-6 relative; top-k ids can only flip where the k-th
  and (k+1)-th logits are closer than that. The test asserts that precondition (min gap > 1e-5 of the
  logit scale, 10x the noise) before asserting identical ids, so it does not depend on luck.
- Routed experts' output under fake quant, same input and routing, vs the source experts: E4M3 with round to
  nearest has relative error <= 2**-4 per element, RMS ~ 2.6% measured on these Gaussian weights (~ 2**-4/sqrt(3)
  at worst); an expert's output carries the errors of gate, up, down and of its two quantized inputs, ~ sqrt(5)
  x 3.6% = 8% in quadrature: bound 0.15. NVFP4 (E2M1: 1 mantissa bit, RMS ~ 10-12% per element after the E4M3
  group scales) -> sqrt(5) x 12% = 27%: bound 0.5. Weight-only must be closer than weights + activations (the
  activations are quantized at both expert inputs).
- Whole-model logits: only finite and different from the source. On this random tiny MoE the whole-model error
  is chaotic, not a format property: router logits have top-2/top-3 gaps comparable to a few % input noise, so
  FP8 already flips the top-2 set for 10-60% of tokens per layer (measured: relative L2 logit error 0.74 for FP8,
  0.64 weight-only; 0.75 with every expert kept BF16, i.e. from the attention/DeltaNet layers' error flipping
  routes). The ordering FP8 closer than NVFP4 is checked in KL, as for the dense family.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

from quantkit.calibrate import resolve_mappings, smooth_model
from quantkit.calibrate.mappings import SmoothMapping, fold_output, input_weight, scale_
from quantkit.checkpoints import CheckpointError
from quantkit.formats.experts import EXPERT_MATRIX, expert_matrices, fused_experts_modules
from quantkit.formats.schemes import get_scheme
from quantkit.models.tiny import randomize_parameters
from quantkit.models.tiny_hybrid import TINY_HYBRID_SHAPE
from quantkit.quantize.checkpoint import quantize_checkpoint
from quantkit.quantize.fake_quant import FakeQuantExperts, load_fake_quant_model
from quantkit.quantize.provenance import with_calibration
from quantkit.quantize.recipe import load_recipe
from quantkit.serve.checkpoint_check import check_servable

SHAPE = dict(  # the zoo's hybrid shape as a stock Qwen3-Next config, with narrower experts
    TINY_HYBRID_SHAPE,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    moe_intermediate_size=96,
    shared_expert_intermediate_size=96,
    decoder_sparse_step=1,
    norm_topk_prob=True,
    max_position_embeddings=512,
)
VOCAB = 256
OUTLIER = 5  # the injected channel of every residual norm


def tiny_qwen3_next(seed: int = 0, outlier: bool = True) -> Qwen3NextForCausalLM:
    """Random float32 Qwen3-Next; `outlier`: channel OUTLIER of every residual norm's effective scale x30."""
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(
        Qwen3NextConfig(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0, **SHAPE)
    )
    randomize_parameters(model, 0.05)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.normal_(0.0, 0.2)  # (1+w)-parameterised: effective scale 1 + w ~ 1
            elif name.endswith("conv1d.weight"):
                param.normal_(0.0, 0.3)
        if outlier:
            for layer in model.model.layers:
                for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                    norm.weight[OUTLIER] = 30 * (1 + norm.weight[OUTLIER]) - 1
    return model.eval()


def tokens(n: int = 8, length: int = 32, seed: int = 1) -> torch.Tensor:
    out = torch.randint(1, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))
    out[:, 0] = 0
    return out


@torch.no_grad()
def logits(model: nn.Module, toks: torch.Tensor) -> torch.Tensor:
    return model(input_ids=toks, use_cache=False).logits.float()


def relative_change(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@torch.no_grad()
def routing_change_after_smoothing(build: Callable[[], nn.Module], top_k: int) -> list[float]:
    """The routing tests: SmoothQuant (experts on) on the model `build` returns leaves every router's top-`top_k`
    ids equal and its logits within 1e-5 relative (asserted; the router input's fold is exact up to rounding, and a
    precondition asserts no near-ties at the k-th place). The control: the same factors folded into a fresh `build`
    everywhere except the router (mlp.gate); returned, per MoE layer, the fraction of held-out tokens whose top-k
    expert set then differs."""
    calib, held_out = tokens(8, 32), tokens(4, 32, seed=2)
    model = build()
    ids_before, router_before = routing(model, held_out)
    for name, r in router_before.items():  # precondition: no near-ties at the k-th place
        top = r.topk(top_k + 1, dim=-1).values
        assert (top[:, -2] - top[:, -1]).min() > 1e-5 * r.abs().max(), name
    report = smooth_model(model, calib, experts=True, progress=False)
    ids_after, router_after = routing(model, held_out)
    for name in ids_before:
        assert torch.equal(ids_before[name], ids_after[name]), name
        assert relative_change(router_after[name], router_before[name]) < 1e-5

    control = build()
    for m in resolve_mappings(control, experts=True).mappings:
        s = report.scales[m.smooth]
        fold_output(control.get_submodule(m.smooth), s)
        for c in m.consumers:
            if not c.endswith("mlp.gate"):
                scale_(input_weight(control.get_submodule(c)), s)
    ids_control, _ = routing(control, held_out)
    return [
        (ids_control[n].sort(-1).values != ids_before[n].sort(-1).values).any(-1).float().mean().item()
        for n in ids_before
    ]


def routing(model: nn.Module, toks: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per MoE layer: the router's top-k expert ids (tokens, k) and its logits (tokens, E)."""
    ids, router_logits = {}, {}
    hooks = []
    for i, layer in enumerate(model.model.layers):

        def hook(_m, _args, out, i=i):
            router_logits[f"layer{i}"], _, ids[f"layer{i}"] = out

        hooks.append(layer.mlp.gate.register_forward_hook(hook))
    logits(model, toks)
    for h in hooks:
        h.remove()
    return ids, router_logits


# --------------------------------------------------------------------------------------- SmoothQuant


def test_mappings_cover_every_consumer_of_every_norm():
    plan = resolve_mappings(tiny_qwen3_next(), include_v_o=True, include_up_down=True)
    by_smooth = {m.smooth: m for m in plan.mappings}
    deltanet = by_smooth["model.layers.0.input_layernorm"]
    assert deltanet.consumers == ("model.layers.0.linear_attn.in_proj_qkvz", "model.layers.0.linear_attn.in_proj_ba")
    assert by_smooth["model.layers.3.input_layernorm"].consumers == tuple(
        f"model.layers.3.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")
    )
    moe = by_smooth["model.layers.1.post_attention_layernorm"]
    assert moe.consumers == tuple(
        f"model.layers.1.mlp.{n}"
        for n in ("gate", "experts", "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert_gate")
    )
    assert moe.fold_only == ("model.layers.1.mlp.gate", "model.layers.1.mlp.shared_expert_gate")
    assert {m.kind for m in plan.mappings} == {"norm", "v_o", "up_down"}
    assert "model.layers.3.self_attn.v_proj" in by_smooth  # the gated softmax layer is linear in v
    assert "model.layers.2.mlp.shared_expert.up_proj" in by_smooth
    assert any("Gated DeltaNet" in s for s in plan.skipped) and any(
        "routed experts' up_proj" in s for s in plan.skipped
    )

    plan = resolve_mappings(tiny_qwen3_next(), experts=False)
    assert all(not m.smooth.endswith("post_attention_layernorm") for m in plan.mappings)
    assert any("experts smoothing off" in s for s in plan.skipped)


def test_offset_rmsnorm_fold_divides_the_output_exactly():
    """Qwen3NextRMSNorm computes x_hat * (1 + w): the fold is w' = (1 + w)/s - 1, not w / s."""
    norm = tiny_qwen3_next().model.layers[0].input_layernorm
    x = torch.randn(3, 128)
    s = torch.rand(128) * 4 + 0.25
    before = norm(x)
    fold_output(norm, s)
    assert torch.allclose(norm(x), before / s, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("experts", [True, False])
def test_smoothing_preserves_function(experts):
    model = tiny_qwen3_next()
    held_out = tokens(4, 32, seed=2)
    reference = logits(model, held_out)
    moe_weights = {
        n: input_weight(model.get_submodule(n)).detach().clone()
        for n in ("model.layers.1.mlp.gate", "model.layers.1.mlp.experts", "model.layers.1.mlp.shared_expert_gate")
    }

    report = smooth_model(model, tokens(8, 32), include_v_o=True, include_up_down=True, experts=experts, progress=False)

    change = relative_change(logits(model, held_out), reference)
    assert change < 1e-4 and report.relative_logit_change < 1e-4, change
    for name, before in moe_weights.items():  # every MoE consumer folded, or none
        assert torch.equal(input_weight(model.get_submodule(name)), before) != experts, name
    smoothed = {m.smooth for m in report.mappings}
    assert ("model.layers.1.post_attention_layernorm" in smoothed) == experts
    if experts:  # the injected outlier at the MoE input is migrated into the weights
        moe = next(m for m in report.mappings if m.smooth == "model.layers.1.post_attention_layernorm")
        assert moe.act_max_after < moe.act_max_before / 2
        assert report.scales["model.layers.1.post_attention_layernorm"].argmax() == OUTLIER
    json.dumps(report.to_dict())


def test_routing_is_unchanged_by_smoothing_and_changes_without_the_router_fold():
    changed = routing_change_after_smoothing(tiny_qwen3_next, SHAPE["num_experts_per_tok"])
    assert min(changed) > 0.1, changed  # x30 outlier: ~sqrt(30) factor on one channel of the router's input


def test_missing_router_fold_breaks_function_preservation_check(monkeypatch):
    """A mapping table that forgets the router is caught by smooth_model's own check and rolled back."""
    from quantkit.calibrate import FunctionPreservationError
    from quantkit.calibrate import mappings as mappings_module

    model = tiny_qwen3_next()
    moe = mappings_module.SPARSE_MOE
    forgetful = dataclasses.replace(
        moe,
        norm=dataclasses.replace(
            moe.norm,
            consumers=tuple(c for c in moe.norm.consumers if c != "mlp.gate"),
            fold_only=("mlp.shared_expert_gate",),
        ),
    )
    family = dataclasses.replace(
        mappings_module.HYBRID, slots=(mappings_module.HYBRID.slots[0], (forgetful, mappings_module.GLU_MLP))
    )

    state = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setitem(mappings_module.ARCHITECTURES, type(model).__name__, family)
    with pytest.raises(FunctionPreservationError):
        smooth_model(model, tokens(8, 32), progress=False)
    for k, v in model.state_dict().items():  # rolled back, up to the rounding of s * (1/s)
        assert torch.allclose(v, state[k], rtol=1e-5, atol=1e-6), k


def test_all_experts_statistics_see_every_token():
    """calibrate-all-experts mode: every expert's down_proj input statistics exist (also for experts the router
    never picks) and the routed output is untouched."""
    from quantkit.calibrate import channel_max

    model = tiny_qwen3_next()
    toks = tokens(2, 16)
    names = [n for n in expert_matrices("model.layers.1.mlp.experts", model.model.layers[1].mlp.experts)]
    reference = logits(model, toks)
    maxima = channel_max(model, toks, names, progress=False)
    assert torch.equal(logits(model, toks), reference)
    assert set(maxima) == set(names)
    experts = model.model.layers[1].mlp.experts
    x_amax = maxima["model.layers.1.mlp.experts.0.gate_proj"]
    assert all(torch.equal(maxima[f"model.layers.1.mlp.experts.{e}.up_proj"], x_amax) for e in range(8))
    assert all(
        maxima[f"model.layers.1.mlp.experts.{e}.down_proj"].shape == (experts.down_proj.shape[-1],) for e in range(8)
    )


# --------------------------------------------------------------------------------------- checkpoints


RECIPES = ["bf16", "w8a8_fp8_block", "w4a4_nvfp4", "w4a4_nvfp4_static", "w4a4_nvfp4_sq"]
BOUND = {"fp8_block": 0.15, "nvfp4": 0.5}  # relative L2 error of the routed experts' output (module docstring)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A stock tiny Qwen3-Next checkpoint written by transformers' save_pretrained (per-expert names)."""
    from quantkit.models.tiny import build_random_checkpoint

    out = tmp_path_factory.mktemp("qwen3next") / "m"
    return build_random_checkpoint(Qwen3NextConfig, Qwen3NextForCausalLM, out, shape=SHAPE)  # BPE: >= 257


def test_source_checkpoint_uses_per_expert_names(source):
    with safe_open(source / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in keys and "model.layers.1.mlp.gate.weight" in keys
    assert not any(k.endswith("gate_up_proj") for k in keys)


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_every_recipe_writes_a_checked_loadable_checkpoint(source, tmp_path, recipe_name):
    recipe = with_calibration(load_recipe(recipe_name), 8, 64)
    out = quantize_checkpoint(source, recipe, tmp_path / recipe_name)
    qc = check_servable(out)
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    with safe_open(source / "model.safetensors", "pt") as f:
        source_keys = set(f.keys())
    toks = tokens(2, 24, seed=3)
    reference = logits(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval(), toks)

    if recipe.scheme == "bf16":  # transformers' own names, loadable by transformers' own loader
        assert qc is None and keys == source_keys
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
        source_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
        for name, value in source_model.items():  # fused experts round-trip: exactly the bf16-rounded source
            assert torch.equal(reloaded[name], value.to(torch.bfloat16).float()), name
        return

    scheme = get_scheme(qc["scheme"])
    quantized = set(qc["quantized_modules"])
    experts = [n for n in quantized if EXPERT_MATRIX.match(n)]
    assert len(experts) == 4 * 8 * 3  # every routed expert matrix of every MoE layer
    for kept in ("lm_head", "model.layers.1.mlp.shared_expert_gate", "model.layers.0.linear_attn.in_proj_ba"):
        assert kept in qc["ignored_modules"] and kept not in quantized
    assert "model.layers.1.mlp.gate.weight" in keys  # the router: no Linear, never quantized
    for suffix in scheme.checkpoint_tensors(qc["activation_scale"]):
        assert f"model.layers.2.mlp.experts.5.down_proj.{suffix}" in keys

    model = load_fake_quant_model(out)
    fq = model.model.layers[2].mlp.experts
    assert isinstance(fq, FakeQuantExperts)
    state = load_file(out / "model.safetensors")
    source_state = load_file(source / "model.safetensors")
    intermediate = SHAPE["moe_intermediate_size"]
    for e in (0, 5):
        for proj, loaded in (
            ("gate_proj", fq.gate_up_proj[e, :intermediate]),
            ("up_proj", fq.gate_up_proj[e, intermediate:]),
            ("down_proj", fq.down_proj[e]),
        ):
            name = f"model.layers.2.mlp.experts.{e}.{proj}"
            tensors = {k.rsplit(".", 1)[1]: v for k, v in state.items() if k.rsplit(".", 1)[0] == name}
            decoded = scheme.decode(tensors, loaded.shape[1])
            assert torch.equal(loaded, decoded), name  # the reference holds exactly the checkpoint's values
            if recipe.smoothquant is None:  # and those are the source's weights, quantized
                w = source_state[f"{name}.weight"]
                assert torch.equal(decoded, scheme.decode(scheme.encode(w, name), w.shape[1])), name
    if recipe.activation_scale == "static":
        assert torch.isfinite(fq.input_global_scale).all() and (fq.input_global_scale > 0).all()

    # the experts alone, same input and routing: the format's error (module docstring); SQ recipes hold
    # smoothed weights (W diag(s)), compared through the whole model only
    if recipe.smoothquant is None:
        source_experts = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).model.layers[2].mlp.experts
        gen = torch.Generator().manual_seed(4)
        x = torch.randn(64, SHAPE["hidden_size"], generator=gen)
        top_k = torch.rand(64, SHAPE["num_experts"], generator=gen).topk(SHAPE["num_experts_per_tok"]).indices
        weights = torch.full(top_k.shape, 1.0 / SHAPE["num_experts_per_tok"])
        with torch.no_grad():
            y_ref = source_experts(x, top_k, weights)
            error = ((fq(x, top_k, weights) - y_ref).norm() / y_ref.norm()).item()
            weight_only = (
                (
                    FakeQuantExperts(
                        scheme,
                        fq.gate_up_proj,
                        fq.down_proj,
                        fq.act_fn,
                        fq.quantized,
                        fq.input_global_scale,
                        quantize_activations=False,
                    )(x, top_k, weights)
                    - y_ref
                ).norm()
                / y_ref.norm()
            ).item()
        assert 0 < weight_only < error < BOUND[scheme.name], (weight_only, error)

    out_logits = logits(model, toks)  # whole model: routing flips make the error chaotic (see the docstring)
    assert torch.isfinite(out_logits).all() and not torch.equal(out_logits, reference)


def test_fp8_is_closer_than_nvfp4(source, tmp_path):
    toks = tokens(4, 32, seed=3)
    reference = torch.log_softmax(
        logits(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval(), toks), -1
    )
    kl = {}
    for name in ("w8a8_fp8_block", "w4a4_nvfp4"):
        out = quantize_checkpoint(source, with_calibration(load_recipe(name), 8, 64), tmp_path / name)
        q = torch.log_softmax(logits(load_fake_quant_model(out), toks), -1)
        kl[name] = (reference.exp() * (reference - q)).sum(-1).mean().item()
    assert 0 < kl["w8a8_fp8_block"] < kl["w4a4_nvfp4"], kl


def test_checker_rejects_incomplete_or_partly_quantized_experts(source, tmp_path):
    from safetensors.torch import save_file

    out = quantize_checkpoint(source, with_calibration(load_recipe("w8a8_fp8_block"), 8, 64), tmp_path / "fp8")
    state = load_file(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())

    broken = {k: v for k, v in state.items() if not k.startswith("model.layers.1.mlp.experts.3.up_proj.")}
    save_file(broken, str(out / "model.safetensors"))
    config["quantization_config"]["quantized_modules"].remove("model.layers.1.mlp.experts.3.up_proj")
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"experts\.3\.up_proj"):
        check_servable(out)

    broken["model.layers.1.mlp.experts.3.up_proj.weight"] = torch.zeros(
        SHAPE["moe_intermediate_size"], SHAPE["hidden_size"]
    )
    save_file(broken, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="partly quantized"):
        check_servable(out)


def test_fused_experts_are_found_by_structure():
    """Subclasses (quantkit's hybrid family) are found without naming them."""
    model = tiny_qwen3_next()
    assert sorted(fused_experts_modules(model)) == [f"model.layers.{i}.mlp.experts" for i in range(4)]
    layer = model.model.layers[1]
    Sub = type("SubExperts", (type(layer.mlp.experts),), {})
    layer.mlp.experts.__class__ = Sub
    plan = resolve_mappings(model)
    assert any(c == "model.layers.1.mlp.experts" for m in plan.mappings for c in m.consumers)
    assert isinstance(plan.mappings[0], SmoothMapping)


def test_recipe_experts_option():
    from quantkit.quantize.recipe import parse_recipe

    assert load_recipe("w4a4_nvfp4_sq").smoothquant.experts is True
    assert load_recipe("w4a4_nvfp4_sq_noexperts").smoothquant.experts is False
    with pytest.raises(ValueError, match="experts must be true or false"):
        parse_recipe({"name": "x", "scheme": "nvfp4", "smoothquant": {"experts": "yes"}})
    recipe = load_recipe("w8a8_fp8_block")
    for name in (
        "model.layers.1.mlp.gate",
        "model.layers.1.mlp.shared_expert_gate",
        "model.layers.0.linear_attn.in_proj_ba",
    ):
        assert recipe.ignores(name), name
    for name in (
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.experts.0.gate_proj",
        "model.layers.0.linear_attn.in_proj_qkvz",
    ):
        assert not recipe.ignores(name), name
