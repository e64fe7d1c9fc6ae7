"""GPTQ on quantkit's grids (`quantkit.quantize.gptq`, recipe key `gptq`, issue 31 item 1).

Asserted and why each cannot fail by chance:
- Uncorrelated inputs (H = I): no error is spread (chol(H^-1) is diagonal), so GPTQ is round to nearest with
  min-max scales (searched scales with `search_scales`: the same search on the same group, MSE clipping): its
  dequantized weight and scales equal `decode(encode(w))` and `encode`'s scales bit for bit.
- The lazy blocks are Algorithm 1 regrouped: run in float64, GPTQ with blocks of 128 and the textbook column loop
  without lazy blocks (the reference below) give the same codes. They differ by float64 summation order, ~1e-15
  relative, so a value would have to lie within ~1e-15 of a rounding midpoint to round differently: probability
  ~1e-13 per element, nil over these 2e4.
- It does what it is for: on strongly correlated inputs (rank-8 signal + 5% noise, seeded) GPTQ's output error
  ||X (W - Q)^T||^2 is below half round-to-nearest's (measured 0.02-0.03 of it here, 2026-11-26; the compensation
  cancels most of the error along the few directions X spans, which a 2x margin leaves room for).
- The encoded checkpoint stores GPTQ's weights exactly: decode(encode(Q, scales)) == Q.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantkit.formats.constants import WeightScales
from quantkit.formats.schemes import SCHEMES
from quantkit.quantize.gptq import _grid, gptq_quantize


def state_of(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from quantkit.checkpoints import weight_files

    return {k: v for f in weight_files(model_dir) for k, v in load_file(str(f)).items()}


def correlated_inputs(tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    basis = torch.randn(8, k, generator=gen)
    return torch.randn(tokens, 8, generator=gen) @ basis + 0.05 * torch.randn(tokens, k, generator=gen)


def reference_gptq(
    w: torch.Tensor,
    h: torch.Tensor,
    scheme: str,
    dampening: float = 0.01,
    search_scales: bool = False,
    act_order: bool = False,
) -> torch.Tensor:
    """Algorithm 1 column by column, no lazy blocks, float64 (the module's dead-channel and dampening rules). With
    act_order: every group's scales first from the weights, then the columns in descending diag(H) order, each
    rounded at its own group's scales, its error spread over the columns not yet quantized in that order."""
    w, h = w.double().clone(), h.double().clone()
    k = w.shape[1]
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += dampening * torch.diag(h).mean() * torch.eye(k, dtype=torch.float64)
    grid, q = _grid(scheme, w, search_scales, static=act_order), torch.zeros_like(w)
    order = sorted(range(k), key=lambda j: -float(h[j, j])) if act_order else list(range(k))
    hp = h[order][:, order]
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hp)), upper=True)
    for i, j in enumerate(order):
        if not act_order:
            grid.start_group(j, w)
        q[:, j] = grid.quantize_column(j, w[:, j])
        rest = order[i:]
        w[:, rest] -= ((w[:, j] - q[:, j]) / u[i, i])[:, None] * u[i, i:][None, :]
    return q


@pytest.mark.parametrize("search_scales", [False, True])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_uncorrelated_inputs_give_round_to_nearest(scheme, search_scales):
    """K = 272: two full FP8 blocks and a short one, 17 NVFP4 groups; min-max scales or searched (MSE) ones."""
    w = torch.randn(160, 272, generator=torch.Generator().manual_seed(1)) * 0.02
    w[::7, ::5] *= 8  # a few large values: the search then picks other scales than min-max in some groups
    q, scales = gptq_quantize(w, torch.eye(272), scheme, search_scales=search_scales)
    s = SCHEMES[scheme]
    rtn = s.encode(w, "w", weight_scales=WeightScales.MSE if search_scales else WeightScales.MINMAX)
    if search_scales:  # the case is not vacuous: the searched scales differ from min-max ones
        assert not torch.equal(rtn["weight_scale"].float(), s.encode(w, "w")["weight_scale"].float())
    assert torch.equal(q, s.decode(rtn, 272))
    for suffix, tensor in scales.items():
        assert torch.equal(tensor.view(torch.uint8), rtn[suffix].view(torch.uint8)), suffix


@pytest.mark.parametrize("search_scales", [False, True])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_lazy_blocks_equal_the_column_loop_and_the_checkpoint_stores_q(scheme, search_scales):
    x = correlated_inputs(512, 272).double()
    w = torch.randn(72, 272, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.02
    h = 2 * x.T @ x / x.shape[0]
    q, _ = gptq_quantize(w, h, scheme, search_scales=search_scales)
    assert torch.equal(q, reference_gptq(w, h, scheme, search_scales=search_scales))
    q32, scales32 = gptq_quantize(w.float(), h, scheme, search_scales=search_scales)
    s = SCHEMES[scheme]
    assert torch.equal(s.decode(s.encode(q32, "w", scales=scales32), 272), q32)


@pytest.mark.parametrize("search_scales", [False, True])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_act_order_equals_the_column_loop_in_diag_order_and_keeps_the_layout(scheme, search_scales):
    """Act-order GPTQ in lazy blocks equals the textbook loop over the columns in descending diag(H) order (float64,
    same argument as above: ~1e-15 relative differences against rounding midpoints), its scales are those round
    to nearest chooses for the unmodified weight (static groups, fixed before GPTQ), and the checkpoint stores it
    exactly in the usual layout. Input energies differ per channel (scaled columns of X), so the order is not
    the identity and the result differs from left-to-right GPTQ."""
    x = (
        correlated_inputs(512, 272).double()
        * torch.linspace(0.2, 3.0, 272, dtype=torch.float64)[
            torch.randperm(272, generator=torch.Generator().manual_seed(4))
        ]
    )
    w = torch.randn(72, 272, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.02
    h = 2 * x.T @ x / x.shape[0]
    q, _ = gptq_quantize(w, h, scheme, search_scales=search_scales, act_order=True)
    assert torch.equal(q, reference_gptq(w, h, scheme, search_scales=search_scales, act_order=True))
    assert not torch.equal(q, gptq_quantize(w, h, scheme, search_scales=search_scales)[0])
    s = SCHEMES[scheme]
    q32, scales32 = gptq_quantize(w.float(), h, scheme, search_scales=search_scales, act_order=True)
    rtn = s.encode(w.float(), "w", weight_scales=WeightScales.MSE if search_scales else WeightScales.MINMAX)
    for suffix, tensor in scales32.items():
        assert torch.equal(tensor.view(torch.uint8), rtn[suffix].view(torch.uint8)), suffix
    assert torch.equal(s.decode(s.encode(q32, "w", scales=scales32), 272), q32)


def test_act_order_gptq_is_llmcompressors_gptq_bit_for_bit(tmp_path):
    """Where the algorithms agree, quantkit's GPTQ is llm-compressor's (0.14.0.1, `quantize_weight`, run in its own
    venv by tests/llmcompressor_gptq.py) on our grids: act-order GPTQ (scales fixed beforehand from the unmodified
    weight, columns in descending diag(H) order, each at its original group's scales) equals llm-compressor's with
    `actorder: weight` and those scales, and with inputs whose diag(H) already descends (order = identity) its
    left-to-right GPTQ at static scales. FP8 128x128 blocks (K = 272: a short block) and NVFP4 groups of 16.
    Both run in float64 with the same dampening (1% of mean diag H), Cholesky factor of H^-1 and lazy blocks of
    128 columns; they differ in float64 summation order (~1e-15 relative), so a code could differ only where a
    value lies within ~1e-15 of a rounding midpoint: probability ~1e-13 per element, nil over these ~2e5. Equal codes
    give FP8 values code x the same float32 scale, exact in float64 in both: bit-equal. NVFP4's effective scale is
    ours s x g (exact in float64), theirs s / (1 / g) (compressed-tensors' global scale encodes: two float64
    roundings), so values agree within a few float64 ulps (2^-50 relative allowed) where any other code would
    differ by >= 1/3 relative (E2M1 neighbours 4 and 6; 0 and 0.5 absolute). Not vacuous: the result differs from
    round to nearest at the same scales. Where they differ (quantkit's default), see docs: left to right, each
    group's scales from the weights as updated when GPTQ reaches it, which llm-compressor does not offer."""
    import subprocess

    from quantkit.quantize.llmcompressor_backend import llmcompressor_python

    k, gen = 272, torch.Generator().manual_seed(4)
    energy = torch.linspace(0.2, 3.0, k, dtype=torch.float64)[torch.randperm(k, generator=gen)]
    x = correlated_inputs(512, k).double() * energy
    w = torch.randn(200, k, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.02
    h = 2 * x.T @ x / x.shape[0]
    descending = torch.argsort(torch.diag(h), descending=True)
    cases, ours, rtn = [], [], []
    for actorder, (wc, hc) in (("weight", (w, h)), (None, (w[:, descending], h[descending][:, descending]))):
        for scheme in ("fp8_block", "nvfp4"):
            q, scales = gptq_quantize(wc, hc, scheme, act_order=True)
            cases.append({"scheme": scheme, "actorder": actorder, "w": wc.contiguous(), "h": hc.contiguous(), **scales})
            ours.append(q)
            rtn.append(gptq_quantize(wc, torch.eye(k, dtype=torch.float64), scheme)[0])
    torch.save(cases, tmp_path / "cases.pt")
    worker = Path(__file__).with_name("llmcompressor_gptq.py")
    subprocess.run(
        [str(llmcompressor_python()), str(worker), str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")], check=True
    )
    theirs = torch.load(tmp_path / "out.pt")
    for case, q, t, r in zip(cases, ours, theirs, rtn, strict=True):
        label = f"{case['scheme']} actorder={case['actorder']}"
        assert not torch.equal(q, r), label
        if case["scheme"] == "fp8_block":
            assert torch.equal(q, t), label
        else:
            assert ((q - t).abs() <= 2**-50 * q.abs()).all(), label


def test_act_order_is_a_validated_recipe_key():
    from quantkit.quantize.recipe import load_recipe, parse_recipe

    assert load_recipe("w4a4_nvfp4_sq_gptq_actorder").gptq.act_order
    assert not load_recipe("w4a4_nvfp4_sq_gptq").gptq.act_order
    with pytest.raises(ValueError, match=r"gptq.act_order must be true or false"):
        parse_recipe({"name": "x", "scheme": "nvfp4", "gptq": {"act_order": "yes"}}, "x.yaml")


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_gptq_lowers_the_output_error_on_correlated_inputs(scheme):
    x = correlated_inputs(1024, 256)
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(3)) * 0.02
    q, _ = gptq_quantize(w, 2 * x.T.double() @ x.double() / x.shape[0], scheme)
    s = SCHEMES[scheme]
    rtn = s.decode(s.encode(w, "w"), 256)
    gptq_error, rtn_error = (x @ (w - q).T).pow(2).sum(), (x @ (w - rtn).T).pow(2).sum()
    print(f"{scheme}: GPTQ output error {gptq_error / rtn_error:.3f} of round to nearest")
    assert gptq_error < 0.5 * rtn_error


def test_a_gptq_recipe_writes_its_weights_exactly_and_names_what_it_cannot_do(tmp_path):
    """The checkpoint of a GPTQ recipe decodes to the model's GPTQ weights (on the grid: encode with GPTQ's scales
    is exact, asserted above) and differs from round to nearest; the streaming path (one layer at a time) writes
    the same bytes (the same float32 operations on the same batches); peer combinations are refused by name; the
    calibration set is recorded."""
    import json

    from quantkit.checkpoints import weight_files
    from quantkit.models.tiny import build_tiny_stock_checkpoint
    from quantkit.quantize.checkpoint import quantize_checkpoint
    from quantkit.quantize.fake_quant import FakeQuantLinear, load_fake_quant_model
    from quantkit.quantize.provenance import calibration_sets
    from quantkit.quantize.recipe import load_recipe, parse_recipe

    source = build_tiny_stock_checkpoint(tmp_path / "llama", "llama", seed=0)
    recipe = tmp_path / "gptq_small.yaml"
    recipe.write_text("name: gptq_small\nscheme: nvfp4\ngptq: {num_sequences: 8, seq_len: 32}\n")
    out = quantize_checkpoint(source, str(recipe), tmp_path / "g")
    rtn = quantize_checkpoint(source, "w4a4_nvfp4", tmp_path / "r")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["recipe"] == "gptq_small"
    gptq_model, rtn_model = load_fake_quant_model(out), load_fake_quant_model(rtn)
    linears = {n: m for n, m in gptq_model.named_modules() if isinstance(m, FakeQuantLinear)}
    assert linears and all(not torch.equal(m.weight, rtn_model.get_submodule(n).weight) for n, m in linears.items())
    assert len(list(weight_files(out))) == 1
    streamed = quantize_checkpoint(source, str(recipe), tmp_path / "s", streaming=True)  # the same bytes
    whole, stream = state_of(out), state_of(streamed)
    assert whole.keys() == stream.keys()
    assert all(torch.equal(v.view(torch.uint8), stream[k].view(torch.uint8)) for k, v in whole.items())
    assert parse_recipe({"name": "x", "scheme": "nvfp4", "gptq": {}, "weight_scales": "mse"}).weight_scales == "mse"
    own_or_peer = "gptq applies to quantkit's own quantized schemes and to llmcompressor NVFP4 only"
    with pytest.raises(ValueError, match=own_or_peer):
        parse_recipe({"name": "x", "scheme": "bf16", "gptq": {}})
    for backend, preset in (("llmcompressor", "FP8_BLOCK"), ("modelopt", "NVFP4")):  # no GPTQ of theirs wired
        with pytest.raises(ValueError, match=own_or_peer):
            parse_recipe({"name": "x", "scheme": preset, "backend": backend, "gptq": {}})
    assert parse_recipe({"name": "x", "scheme": "NVFP4", "backend": "llmcompressor", "gptq": {}}).gptq is not None
    assert [s["use"] for s in calibration_sets(load_recipe("w4a4_nvfp4_gptq"))] == ["gptq"]


def test_routed_experts_get_per_expert_hessians_and_are_stored_exactly(tmp_path):
    """Routed experts (Qwen3-MoE, 4 experts top-2): each expert matrix gets GPTQ with its own Hessian from the tokens
    routed to it (gate/up: the block input, down: act(gate) * up), so the checkpoint decodes to GPTQ's weights, which
    differ from round to nearest; the experts' gate_proj and up_proj share their Hessian (one input). Asserted on the
    fused model: every expert matrix changed from RTN and is on the grid (encode with GPTQ's scales is exact, tested
    above), and `_layer_hessians` on one layer yields a Hessian per expert matrix reached, gate = up. The streaming
    path writes the same bytes."""
    from transformers import AutoModelForCausalLM

    from quantkit.calibrate.layers import decoder_stack, embed_stream
    from quantkit.formats.experts import expert_matrices, fused_experts_modules
    from quantkit.models.tiny import build_tiny_stock_checkpoint
    from quantkit.quantize.checkpoint import quantize_checkpoint
    from quantkit.quantize.fake_quant import FakeQuantExperts, load_fake_quant_model
    from quantkit.quantize.gptq import _layer_hessians

    source = build_tiny_stock_checkpoint(tmp_path / "moe", "qwen3_moe", seed=0)
    recipe = tmp_path / "gptq_small.yaml"
    recipe.write_text("name: gptq_small\nscheme: nvfp4\ngptq: {num_sequences: 8, seq_len: 32}\n")
    out = quantize_checkpoint(source, str(recipe), tmp_path / "g", streaming=False)
    streamed = state_of(quantize_checkpoint(source, str(recipe), tmp_path / "s", streaming=True))
    assert all(torch.equal(v.view(torch.uint8), streamed[k].view(torch.uint8)) for k, v in state_of(out).items())
    gptq_model = load_fake_quant_model(out)
    rtn_model = load_fake_quant_model(quantize_checkpoint(source, "w4a4_nvfp4", tmp_path / "r"))
    experts = {n: m for n, m in gptq_model.named_modules() if isinstance(m, FakeQuantExperts)}
    assert experts
    for name, module in experts.items():
        rtn = expert_matrices(name, rtn_model.get_submodule(name))
        changed = [m for m, w in expert_matrices(name, module).items() if not torch.equal(w, rtn[m])]
        assert len(changed) == len(rtn), (name, sorted(set(rtn) - set(changed))[:3])

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    stack, layers = decoder_stack(model)
    tokens = torch.randint(0, 500, (4, 32), generator=torch.Generator().manual_seed(0))
    stream = embed_stream(model, layers, "test", tokens, None, 4)
    fused = {f"{stack}.0.{n}": m for n, m in fused_experts_modules(layers[0]).items()}
    with torch.no_grad():
        hessians = _layer_hessians(layers[0], 0, stream, {}, fused)
    ((name, module),) = fused.items()
    reached = {m for m in expert_matrices(name, module) if m in hessians}
    assert len(reached) == len(expert_matrices(name, module))  # 128 tokens x top-2 over 4 experts reach all
    for e in range(4):
        assert torch.equal(hessians[f"{name}.{e}.gate_proj"], hessians[f"{name}.{e}.up_proj"])
        assert hessians[f"{name}.{e}.down_proj"].shape[0] == module.down_proj.shape[2]


def test_gptq_with_searched_scales_streams_the_same_bytes(tmp_path):
    """`weight_scales: mse` + `gptq`: the whole-model and streaming paths pass the search to GPTQ alike (the same
    float32 operations on the same batches, so the same bytes), and the searched scales are not min-max GPTQ's."""
    from quantkit.models.tiny import build_tiny_stock_checkpoint
    from quantkit.quantize.checkpoint import quantize_checkpoint

    source = build_tiny_stock_checkpoint(tmp_path / "llama", "llama", seed=0)
    for name, extra in (("gptq_mse", "weight_scales: mse\n"), ("gptq_minmax", "")):
        (tmp_path / f"{name}.yaml").write_text(
            f"name: {name}\nscheme: nvfp4\n{extra}gptq: {{num_sequences: 8, seq_len: 32}}\n"
        )
    whole = state_of(quantize_checkpoint(source, str(tmp_path / "gptq_mse.yaml"), tmp_path / "w", streaming=False))
    stream = state_of(quantize_checkpoint(source, str(tmp_path / "gptq_mse.yaml"), tmp_path / "s", streaming=True))
    minmax = state_of(quantize_checkpoint(source, str(tmp_path / "gptq_minmax.yaml"), tmp_path / "m", streaming=False))
    assert whole.keys() == stream.keys() == minmax.keys()
    assert all(torch.equal(v.view(torch.uint8), stream[k].view(torch.uint8)) for k, v in whole.items())
    scales = [k for k in whole if k.endswith(".weight_scale")]
    assert scales and any(not torch.equal(whole[k].view(torch.uint8), minmax[k].view(torch.uint8)) for k in scales)


def test_gptq_after_a_fold_reads_the_folded_inputs(tmp_path, monkeypatch):
    """GPTQ composed with a fold (SmoothQuant's or AWQ's scales, `w4a4_nvfp4_sq_gptq`,
    `w4a4_nvfp4_static_awq_wonly_gptq_mse`) runs on the folded model: the Hessian GPTQ uses for layer 0's q_proj is
    that of its smoothed input x / s, diag(1/s) H_raw diag(1/s), with s read back from the checkpoint's folded norm
    (source norm / stored norm, float32). The other order is a real defect: llm-compressor 0.14 stacks AWQ -> GPTQ
    with the Hessians accumulated in the calibration pass before AWQ folds (its KL on SmolLM2: 1.7x plain W4A4's,
    docs/results/methods-study-smollm.md).
    Tolerance, per entry (i, j), relative to sqrt(H_ii H_jj) (Cauchy-Schwarz bounds sum |x_i x_j| by it): each
    Hessian is float32 products summed over <= 256 tokens a batch (<= 256 x 2**-24 = 1.5e-5 each, two Hessians),
    the fold's float32 rounding of x / s (a few 2**-24): 1e-4 bounds it with 3x margin. A Hessian in the raw
    coordinates misses by |1/(s_i s_j) - 1|, asserted far larger (the smoothing scales are not ~1)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import quantkit.quantize.gptq as gptq_module
    from quantkit.models.tiny import build_tiny_stock_checkpoint
    from quantkit.quantize.checkpoint import quantize_checkpoint

    source = build_tiny_stock_checkpoint(tmp_path / "llama", "llama", seed=0)
    recorded: dict[str, torch.Tensor] = {}
    layers, hessians = gptq_module.gptq_layers, gptq_module._layer_hessians

    def record_tokens(model, tokens, *args, **kwargs):
        recorded["tokens"] = tokens.clone()
        return layers(model, tokens, *args, **kwargs)

    def record_hessians(layer, i, stream, linears, experts):
        found = hessians(layer, i, stream, linears, experts)
        if i == 0:
            recorded["h"] = found["model.layers.0.self_attn.q_proj"].clone()
        return found

    monkeypatch.setattr(gptq_module, "gptq_layers", record_tokens)
    monkeypatch.setattr(gptq_module, "_layer_hessians", record_hessians)
    recipe = tmp_path / "sq_gptq_small.yaml"
    recipe.write_text(
        "name: sq_gptq_small\nscheme: nvfp4\nsmoothquant: {alpha: 0.5, num_sequences: 8, seq_len: 32}\n"
        "gptq: {num_sequences: 8, seq_len: 32}\n"
    )
    out = quantize_checkpoint(source, str(recipe), tmp_path / "q")

    norm = "model.layers.0.input_layernorm.weight"
    source_norm, folded_norm = load_file(source / "model.safetensors")[norm], load_file(out / "model.safetensors")[norm]
    assert source_norm.dtype == folded_norm.dtype == torch.float32
    s = source_norm.double() / folded_norm.double()  # the smoothing scales SmoothQuant folded into the norm
    assert (s - 1).abs().max() > 0.1, "nothing was smoothed: the test would not tell the two orders apart"

    model = AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.float32).eval()
    inputs = []
    handle = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, o: inputs.append(a[0]))
    with torch.no_grad():
        model(recorded["tokens"])
    handle.remove()
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs]).double()
    raw = 2 * x.T @ x / x.shape[0]  # the source model's (unsmoothed) Hessian on the same windows

    h = recorded["h"]
    scale = torch.sqrt(torch.outer(h.diagonal(), h.diagonal()))
    folded = raw / torch.outer(s, s)
    assert ((h - folded).abs() / scale).max() <= 1e-4
    assert ((h - raw).abs() / scale).max() > 100 * 1e-4  # the raw coordinates would be caught
