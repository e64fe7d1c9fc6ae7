"""`quantkit quantize` writes checkpoints in docs/checkpoint-format.md; the fake-quant model reads them exactly."""

import copy
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from quantkit.checkpoints import CheckpointError
from quantkit.formats import dequantize_fp8_block, quantize_fp8_block, quantize_nvfp4_weight
from quantkit.quantize.checkpoint import quantize_checkpoint
from quantkit.quantize.fake_quant import FakeQuantLinear, load_fake_quant_model
from quantkit.quantize.recipe import CalibrationSettings

IDS = torch.tensor([[0, 5, 9, 44, 100, 7, 300, 12, 81, 3]])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from quantkit.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("src") / "m", attn_output_gate="headwise", gated_norm_rank=16)


def _kl(ref_logits, logits) -> float:
    p, q = torch.log_softmax(ref_logits, -1), torch.log_softmax(logits, -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def test_fp8_block_checkpoint_contents(source, tmp_path):
    out = quantize_checkpoint(source, "w8a8_fp8_block", tmp_path / "fp8")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "quantkit" and qc["scheme"] == "fp8_block" and qc["weight_block_size"] == [128, 128]
    assert "lm_head" in qc["ignored_modules"] and "model.layers.0.input_layernorm.gate_down" in qc["ignored_modules"]
    assert "model.layers.0.self_attn.g_proj" in qc["quantized_modules"]
    state = load_file(out / "model.safetensors")
    ref = load_file(source / "model.safetensors")
    w = ref["model.layers.1.mlp.down_proj.weight"]
    q, s = quantize_fp8_block(w)
    assert state["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(state["model.layers.1.mlp.down_proj.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(state["model.layers.1.mlp.down_proj.weight_scale"], s)
    assert torch.equal(state["lm_head.weight"], ref["lm_head.weight"])  # ignored: unchanged
    assert torch.equal(
        state["model.layers.0.input_layernorm.gate_down.weight"], ref["model.layers.0.input_layernorm.gate_down.weight"]
    )


def test_nvfp4_checkpoint_contents(source, tmp_path):
    out = quantize_checkpoint(source, "w4a4_nvfp4", tmp_path / "nvfp4")
    state = load_file(out / "model.safetensors")
    w = load_file(source / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    t = quantize_nvfp4_weight(w)
    name = "model.layers.0.self_attn.q_proj"
    assert f"{name}.weight" not in state
    assert torch.equal(state[f"{name}.weight_packed"], t.packed)
    assert torch.equal(state[f"{name}.weight_scale"].view(torch.uint8), t.block_scale.view(torch.uint8))
    assert torch.equal(state[f"{name}.weight_global_scale"], t.global_scale.reshape(1))


def test_fake_quant_reference(source, tmp_path):
    ref = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits = ref(IDS).logits
    kl = {}
    for recipe in ("w8a8_fp8_block", "w4a4_nvfp4"):
        model = load_fake_quant_model(quantize_checkpoint(source, recipe, tmp_path / recipe))
        layer = model.get_submodule("model.layers.1.mlp.down_proj")
        assert isinstance(layer, FakeQuantLinear)
        assert isinstance(model.get_submodule("lm_head"), torch.nn.Linear)
        if recipe == "w8a8_fp8_block":  # decoded weight = the format's dequantization, exactly
            w = ref.get_submodule("model.layers.1.mlp.down_proj").weight
            assert torch.equal(layer.weight, dequantize_fp8_block(*quantize_fp8_block(w)))
        with torch.no_grad():
            kl[recipe] = _kl(ref_logits, model(IDS).logits)
    # quantization costs something, FP8 far less than NVFP4
    assert 0 < kl["w8a8_fp8_block"] < kl["w4a4_nvfp4"] < 1.0, kl


def test_bf16_recipe_and_errors(source, tmp_path):
    out = quantize_checkpoint(source, "bf16", tmp_path / "bf16")
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert all(t.dtype == torch.bfloat16 for t in load_file(out / "model.safetensors").values())
    with pytest.raises(FileExistsError, match="overwrite"):
        quantize_checkpoint(source, "bf16", out)
    with pytest.raises(CheckpointError, match=r"no config.json"):
        quantize_checkpoint(tmp_path / "nothing", "bf16", tmp_path / "x")
    with pytest.raises(ValueError, match="no quantization_config"):
        load_fake_quant_model(out)
    assert not list(tmp_path.glob(".*tmp*")), "no temporary directories left behind"


def test_cli(source, tmp_path):
    quantkit = Path(sys.executable).parent / "quantkit"
    out = subprocess.run(
        [quantkit, "quantize", str(source), "w8a8_fp8_block", str(tmp_path / "q")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "q" / "model.safetensors").exists()
    assert re.search(r"cost: \d+\.\d s \(calibration and quantization\), peak RSS \d+\.\d\d GiB", out.stdout), (
        out.stdout
    )
    # --calibration resizes SmoothQuant's set (the recipe's 4096 x 512 would take hours) and says so first
    out = subprocess.run(
        [quantkit, "quantize", str(source), "w8a8_fp8_block_sq", str(tmp_path / "sq"), "--calibration", "3", "16"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "calibration (smoothquant): 3 x 16 tokens" in out.stdout
    report = json.loads((tmp_path / "sq" / "smoothquant.json").read_text())
    assert (report["num_sequences"], report["seq_len"]) == (3, 16)


def test_smoothquant_and_static_recipes(source, tmp_path):
    """SQ recipes fold SmoothQuant first (report saved); the static NVFP4 recipe stores calibrated scales."""
    from quantkit.quantize.recipe import parse_recipe

    quick = dict(num_sequences=8, seq_len=64)
    sq = parse_recipe({"name": "sq", "scheme": "nvfp4", "smoothquant": {"alpha": 0.5, **quick}})
    out = quantize_checkpoint(source, sq, tmp_path / "sq")
    report = json.loads((out / "smoothquant.json").read_text())
    assert report["relative_logit_change"] <= report["tolerance"]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["smoothquant"]["alpha"] == 0.5
    plain = load_file(quantize_checkpoint(source, "w4a4_nvfp4", tmp_path / "plain") / "model.safetensors")
    smoothed = load_file(out / "model.safetensors")
    assert not torch.equal(
        smoothed["model.layers.0.mlp.gate_proj.weight_scale"].float(),
        plain["model.layers.0.mlp.gate_proj.weight_scale"].float(),
    )

    static = parse_recipe({"name": "st", "scheme": "nvfp4", "activation_scale": "static", "calibration": quick})
    out = quantize_checkpoint(source, static, tmp_path / "static")
    state = load_file(out / "model.safetensors")
    scale = state["model.layers.0.self_attn.q_proj.input_global_scale"]
    assert scale.shape == (1,) and scale.item() > 0
    model = load_fake_quant_model(out)
    assert torch.equal(model.get_submodule("model.layers.0.self_attn.q_proj").input_global_scale, scale)
    with torch.no_grad():
        assert torch.isfinite(model(IDS).logits).all()


def test_quality_table(source, tmp_path):
    """Per-layer SNR and KL: FP8 beats NVFP4 on every measure; SmoothQuant's reference is the smoothed source."""
    from transformers import AutoTokenizer

    from quantkit.data import calibration_windows
    from quantkit.quantize.quality import quality, quality_table
    from quantkit.quantize.recipe import parse_recipe

    sq = parse_recipe(
        {"name": "fp8_sq", "scheme": "fp8_block", "smoothquant": {"alpha": 0.5, "num_sequences": 8, "seq_len": 64}}
    )
    dirs = [
        quantize_checkpoint(source, r, tmp_path / n)
        for n, r in [("fp8", "w8a8_fp8_block"), ("nvfp4", "w4a4_nvfp4"), ("sq", sq)]
    ]
    table, (fp8, nvfp4, fp8_sq) = quality_table(source, dirs, num_sequences=4, seq_len=64)
    assert table.split("\n\n")[0].count("\n") == 4 and "| w8a8_fp8_block |" in table
    # the blocks' noise (self_attn, mlp), then where the noise sits per projection kind (sensitivity_by_kind)
    by_block, by_kind = (part.splitlines() for part in table.split("\n\n")[1:3])
    assert len(by_block) == 2 + 3 and "| self_attn block SNR mean (min @ layer), dB |" in by_block[0]
    assert len(by_kind) == 2 + 3 and by_kind[0].startswith("| recipe | ") and "SNR mean (min @ layer), dB" in by_kind[0]
    assert "block" not in by_kind[0]
    assert set(nvfp4["block_sensitivity"]) == {"self_attn", "mlp"} and fp8["block_sensitivity"]["mlp"]["mean_db"] > (
        nvfp4["block_sensitivity"]["mlp"]["mean_db"] + 6
    )
    layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    down = {int(n.split(".")[2]): v for n, v in nvfp4["layer_snr_db"].items() if n.endswith(".mlp.down_proj")}
    assert nvfp4["sensitivity"]["mlp.down_proj"]["layers"] == down and len(down) == layers
    assert fp8["min_snr_db"] > nvfp4["min_snr_db"] + 6 and 0 < fp8["kl"] < nvfp4["kl"]
    assert set(fp8["layer_snr_db"]) == set(
        json.loads((dirs[0] / "config.json").read_text())["quantization_config"]["quantized_modules"]
    )
    # FP8 per-layer SNR ~ 30 dB; with the right (smoothed) reference the SQ checkpoint is comparable, not negative
    assert fp8_sq["min_snr_db"] > 20 and abs(fp8_sq["mean_snr_db"] - fp8["mean_snr_db"]) < 6

    # --data: the same measurement on windows of another text (here: a .txt file), exactly those windows
    text = tmp_path / "domain.txt"
    text.write_text(" ".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(400)))
    _, (on_text,) = quality_table(source, dirs[1:2], num_sequences=4, seq_len=64, data=str(text))
    windows = calibration_windows(AutoTokenizer.from_pretrained(source), 4, 64, str(text))
    assert on_text == quality(source, dirs[1], windows) and on_text["kl"] != nvfp4["kl"]


def test_block_snr_needs_no_record_of_a_fold_the_projection_snr_does(source, tmp_path, monkeypatch):
    """A peer's checkpoint folds its AWQ scales in without recording them. Simulated on a quantkit SmoothQuant
    checkpoint read as if its factors were not recorded (the reference then stays unsmoothed): each block's SNR
    (`block_snr_db`: the block's output, where the fold cancels) is the one measured with the record, while the
    projections the fold scaled read inputs off by a factor per channel and their SNR collapses.

    Tolerance, derived: the two references compute the same function and differ only by float32 rounding of the
    folded weights and of every GEMM after them: relative epsilon <= (4L + 1) K u (u = 2^-24, K <= 256 the longest
    reduction, L = 2 layers): ~1e-4. The noise energy of a block at SNR s dB then moves by at most 2 eps 10^(s/20)
    (s <= 40: < 0.02) relative through the continuous part, and through E2M1 roundings flipped by the moved inputs
    (a fraction ~eps of the elements, each at most one step, ~12x a rounding error's mean energy) by ~12 eps:
    together under 2.5%, 0.1 dB. The collapse: SmoothQuant's factors here span more than 2x (asserted), so the
    unsmoothed reference's input of a smoothed projection is off by O(1) per channel: its SNR drops far more than
    3 dB."""
    from transformers import AutoTokenizer

    import quantkit.quantize.quality as quality_module
    from quantkit.data import heldout_windows
    from quantkit.quantize.output import read_smoothquant_factors
    from quantkit.quantize.recipe import parse_recipe

    sq = parse_recipe(
        {"name": "nvfp4_sq", "scheme": "nvfp4", "smoothquant": {"alpha": 0.5, "num_sequences": 8, "seq_len": 64}}
    )
    out = quantize_checkpoint(source, sq, tmp_path / "sq")
    factors = read_smoothquant_factors(out)["model.layers.0.input_layernorm"]
    assert factors.max() > 2 * factors.min()
    tokens = heldout_windows(AutoTokenizer.from_pretrained(source), 4, 64)
    recorded = quality_module.quality(source, out, tokens)
    read = quality_module.read_any_quantization_config
    monkeypatch.setattr(quality_module, "read_any_quantization_config", lambda d: {**read(d), "smoothquant": None})
    unrecorded = quality_module.quality(source, out, tokens)

    layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    blocks = {f"model.layers.{i}.{b}" for i in range(layers) for b in ("self_attn", "mlp")}
    assert set(recorded["block_snr_db"]) == set(unrecorded["block_snr_db"]) == blocks
    for name in blocks:
        assert abs(recorded["block_snr_db"][name] - unrecorded["block_snr_db"][name]) <= 0.1, name
    q_proj = "model.layers.0.self_attn.q_proj"  # its input is input_layernorm's: smoothed
    assert unrecorded["layer_snr_db"][q_proj] < recorded["layer_snr_db"][q_proj] - 3


def test_each_block_reads_the_references_input_not_the_quantized_streams(source, tmp_path):
    """Block SNR measures each block alone: the MLP reads the reference's attention output, not the quantized
    attention's. So two checkpoints whose MLPs are the same bytes (NVFP4 everywhere vs FP8 attention + the same NVFP4
    MLPs) have the same MLP block SNR bit for bit (the same float32 operations on the same inputs), while their
    attention blocks differ (FP8's noise is ~2^-4 of NVFP4's in amplitude: > 6 dB apart)."""
    from transformers import AutoTokenizer

    from quantkit.data import heldout_windows
    from quantkit.quantize.quality import quality

    tokens = heldout_windows(AutoTokenizer.from_pretrained(source), 4, 64)
    nvfp4, mixed = (
        quality(source, quantize_checkpoint(source, r, tmp_path / r), tokens)
        for r in ("w4a4_nvfp4", "mixed_fp8_attn_nvfp4")
    )
    mlp = [n for n in nvfp4["block_snr_db"] if n.endswith(".mlp")]
    attention = [n for n in nvfp4["block_snr_db"] if n.endswith(".self_attn")]
    assert mlp and attention and set(mixed["block_snr_db"]) == set(nvfp4["block_snr_db"])
    assert all(mixed["block_snr_db"][n] == nvfp4["block_snr_db"][n] for n in mlp)
    assert all(mixed["block_snr_db"][n] > nvfp4["block_snr_db"][n] + 6 for n in attention)


def whole_model_kl(reference, quantized, tokens) -> tuple[torch.Tensor, float]:
    """(each window's mean KL(reference || quantized), float64 (N,); the bound on its difference from `quality`'s
    layer-by-layer figure): the two whole float32 models one window at a time, and |dKL| <= 2 delta (1 + max|log p -
    log q|), delta = (4L + 1) K u max|logit| (test_layerwise_quality_equals_the_whole_models derives it)."""
    with torch.no_grad():
        a = torch.cat([reference(w).logits for w in tokens.split(1)])
        b = torch.cat([quantized(w).logits for w in tokens.split(1)])
    p, q = torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)
    config = reference.config
    k = max(config.intermediate_size, config.hidden_size, config.num_attention_heads * config.head_dim)
    delta = (4 * config.num_hidden_layers + 1) * k * 2**-24 * a.abs().max().item()
    return (p.exp() * (p - q)).sum(-1).mean(-1), 2 * delta * (1 + (p - q).abs().max().item())


def test_layerwise_quality_equals_the_whole_models(source, tmp_path):
    """`quality` runs one layer of each model at a time; its KL and SNRs equal those of the two whole models (the
    float32 source with the checkpoint's SmoothQuant factors folded in, and `load_fake_quant_model`) up to float32
    summation order. Bound, derived: the two paths run the same float32 operations on batches of different size
    (8 windows vs 1), so each GEMM's sum may be reordered: a relative change <= K u (u = 2^-24, K the longest
    reduction) per GEMM, accumulated over the 4 GEMMs of each of the L layers and the head: a logit moves by at
    most delta = (4L + 1) K u max|logit|. KL(p || q) moves by at most 2 delta through q's logits (its gradient
    q - p has L1 norm <= 2) and 2 delta max|log p - log q| through p's: |dKL| <= 2 delta (1 + max|log p - log q|)."""
    from transformers import AutoTokenizer

    from quantkit.calibrate.mappings import resolve_mappings
    from quantkit.calibrate.smoothquant import fold_mapping
    from quantkit.data import heldout_windows
    from quantkit.quantize.output import read_smoothquant_factors
    from quantkit.quantize.quality import quality
    from quantkit.quantize.recipe import parse_recipe

    sq = parse_recipe(
        {"name": "nvfp4_sq", "scheme": "nvfp4", "smoothquant": {"alpha": 0.5, "num_sequences": 8, "seq_len": 64}}
    )
    out = quantize_checkpoint(source, sq, tmp_path / "sq")
    tokens = heldout_windows(AutoTokenizer.from_pretrained(source), 10, 64)  # a full batch of 8 and a partial one
    layerwise = quality(source, out, tokens)

    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    factors = read_smoothquant_factors(out)
    for m in resolve_mappings(reference).mappings:
        fold_mapping(reference, m, factors[m.smooth])
    fake_quant = load_fake_quant_model(out)
    whole_per_window, bound = whole_model_kl(reference, fake_quant, tokens)
    whole_kl = whole_per_window.mean().item()  # every window has T positions: the mean over all of them
    # top-1 agreement: the same argmax comparison; a position can flip between the two paths only where either
    # model's two largest logits are within 2 delta (delta: the logit bound whole_model_kl derives), so the two
    # agreements differ by at most the fraction of such near-tie positions
    with torch.no_grad():
        a = torch.cat([reference(w).logits for w in tokens.split(1)])
        b = torch.cat([fake_quant(w).logits for w in tokens.split(1)])
    delta = bound / (2 * (1 + (torch.log_softmax(a.double(), -1) - torch.log_softmax(b.double(), -1)).abs().max()))
    near_tie = torch.zeros(a.shape[:2], dtype=torch.bool)
    for logits in (a, b):
        top2 = logits.topk(2, -1).values
        near_tie |= (top2[..., 0] - top2[..., 1]) <= 2 * delta
    whole_top1 = (a.argmax(-1) == b.argmax(-1)).double().mean().item()
    assert abs(layerwise["top1_agreement"] - whole_top1) <= near_tie.double().mean().item() + 1e-12
    assert whole_top1 < 1  # NVFP4 changes choices (measured 2026-11-30: 47.8% agree, 1.9% of positions near a tie)
    assert abs(layerwise["kl"] - whole_kl) <= bound, (layerwise["kl"], whole_kl, bound)
    assert bound < layerwise["kl"] / 2  # the bound is well below the effect measured: a wrong layer would show
    assert len(layerwise["kl_per_window"]) == len(tokens)
    assert all(abs(x - y) <= bound for x, y in zip(layerwise["kl_per_window"], whole_per_window.tolist()))
    assert set(layerwise["layer_snr_db"]) == set(
        json.loads((out / "config.json").read_text())["quantization_config"]["quantized_modules"]
    )


def test_unmappable_model_is_refused_before_its_weights_load(source, tmp_path, monkeypatch):
    """A registered architecture SmoothQuant cannot fold (here: its norm class's fold removed) is refused from
    config.json alone, on the meta device: the weights are never read, and nothing is written."""
    import quantkit.quantize.checkpoint as checkpoint_module
    from quantkit.calibrate import SmoothQuantMappingError, mappings
    from quantkit.models.modeling import QuantkitNorm

    monkeypatch.delitem(mappings._FOLDS, QuantkitNorm)

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the refusal")

    monkeypatch.setattr(checkpoint_module, "load_reference_model", no_load)
    with pytest.raises(SmoothQuantMappingError, match=r"QuantkitNorm: no fold registered"):
        quantize_checkpoint(source, "w8a8_fp8_block_sq", tmp_path / "out", streaming=False)
    assert not (tmp_path / "out").exists()
    # an architecture without a table entry (Phi-3): its traced rule runs on the skeleton, random weights
    from transformers.models.phi3.modeling_phi3 import Phi3RMSNorm

    from quantkit.models.tiny import build_tiny_stock_checkpoint

    phi3 = build_tiny_stock_checkpoint(tmp_path / "phi3", "phi3")
    monkeypatch.delitem(mappings._FOLDS, Phi3RMSNorm)
    with pytest.raises(SmoothQuantMappingError, match=r"Phi3RMSNorm: no fold registered.*still work"):
        quantize_checkpoint(phi3, "w8a8_fp8_block_sq", tmp_path / "out", streaming=False)
    assert not (tmp_path / "out").exists()


def test_llmcompressor_peer_recipes(source, tmp_path):
    """The peers' presets run through llmcompressor in its own venv; their weights match our formats."""
    from quantkit.formats import quantize_nvfp4
    from quantkit.quantize.provenance import calibration_sets
    from quantkit.quantize.recipe import parse_recipe

    name = "model.layers.1.mlp.down_proj"
    w = load_file(source / "model.safetensors")[f"{name}.weight"]
    out = quantize_checkpoint(source, "fp8_block_ct", tmp_path / "fp8_ct")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    state = load_file(out / "model.safetensors")
    q, scale = quantize_fp8_block(w)
    assert torch.equal(state[f"{name}.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(state[f"{name}.weight_scale"].float(), scale)

    nvfp4_ct = parse_recipe(
        {
            "name": "nvfp4_ct",
            "scheme": "NVFP4",
            "backend": "llmcompressor",
            "calibration": {"num_sequences": 4, "seq_len": 64},
        }
    )
    out = quantize_checkpoint(source, nvfp4_ct, tmp_path / "nvfp4_ct")
    state = load_file(out / "model.safetensors")
    assert f"{name}.input_global_scale" in state  # compressed-tensors' static activation scale (encode convention)
    ours = quantize_nvfp4(w, 1.0 / state[f"{name}.weight_global_scale"].float().reshape(()))
    # c-t divides by scale / g, we by scale * (1 / g): last-bit differences flip only elements within ~1 ulp of
    # an E2M1 rounding bound, an expected fraction ~1e-6 (a few bounds per binade x 2**-22); 1e-3 is > 100x that
    same = (state[f"{name}.weight_packed"] == ours.packed).float().mean().item()
    assert same > 0.999, f"only {same:.4f} of the packed bytes agree with quantkit's NVFP4 at CT's global scale"

    # the peer's GPTQ (issue 51 item 5): llm-compressor's GPTQModifier with the NVFP4 preset, on one dataset for its
    # Hessians and its static scales; same format, other roundings. GPTQ feeds each column's rounding error into the
    # later columns (a fraction of a step each), so it moves far more than the ~1e-6 of last-bit flips above: more
    # than 1% of the bytes must differ from round to nearest at the same global scale.
    gptq = {"num_sequences": 4, "seq_len": 64}
    gptq_ct = parse_recipe({"name": "nvfp4_ct_gptq", "scheme": "NVFP4", "backend": "llmcompressor", "gptq": gptq})
    assert [s["use"] for s in calibration_sets(gptq_ct)] == ["gptq and activation scales"]
    out = quantize_checkpoint(source, gptq_ct, tmp_path / "nvfp4_ct_gptq")
    state = load_file(out / "model.safetensors")
    rtn = quantize_nvfp4(w, 1.0 / state[f"{name}.weight_global_scale"].float().reshape(()))
    moved = (state[f"{name}.weight_packed"] != rtn.packed).float().mean().item()
    assert moved > 0.01, f"GPTQ moved only {moved:.4f} of the packed bytes from round to nearest"


def test_llmcompressor_peer_transforms(source, tmp_path):
    """The peers at their best (issue 51 item 5): llm-compressor's own AWQModifier and SpinQuantModifier run before
    its NVFP4 quantization, in its venv. AWQ folds its scales into the norms it smooths; SpinQuant's R1 with
    16-wide blocks is the block-diagonal Hadamard of quantkit.formats.hadamard applied to the centered embedding;
    its transform_config lists only offline (weight) locations. AWQ runs in llm-compressor's sequential pipeline,
    whose fx tracing cannot wrap the zoo's models: refused with the reason."""
    from quantkit.errors import BackendError
    from quantkit.formats.hadamard import block_hadamard
    from quantkit.models.tiny import build_tiny_stock_checkpoint
    from quantkit.quantize.provenance import calibration_sets
    from quantkit.quantize.quality import quality_table
    from quantkit.quantize.recipe import parse_recipe

    llama = build_tiny_stock_checkpoint(tmp_path / "llama", "llama", seed=0, dtype=torch.bfloat16)
    src = load_file(llama / "model.safetensors")
    small = {"num_sequences": 4, "seq_len": 64}
    peer = {"scheme": "NVFP4", "backend": "llmcompressor"}
    awq = parse_recipe({**peer, "name": "awq", "calibration": small, "peer_modifiers": {"AWQModifier": {"n_grid": 5}}})
    assert [s["use"] for s in calibration_sets(awq)] == ["awq and activation scales"]
    state = load_file(quantize_checkpoint(llama, awq, tmp_path / "awq") / "model.safetensors")
    norms = [k for k in src if k.endswith("layernorm.weight")]
    # AWQ divides each smoothed norm's weight by its searched scales (all positive, normalised to geometric mean 1):
    # a norm it smoothed differs from the source, one it skipped is bit-identical
    assert any(not torch.equal(state[k], src[k]) for k in norms), "AWQ folded no scales into any norm"
    # llm-compressor runs on a float32 copy; what it does not quantize is saved in the source's bfloat16 (the
    # embedding bit-identical), and the config says so: a float32 save is twice the size of the user's checkpoint
    unquantized = {k: t.dtype for k, t in state.items() if k.endswith((".weight", ".bias"))}
    assert set(unquantized.values()) == {torch.bfloat16}, unquantized
    assert torch.equal(state["model.embed_tokens.weight"], src["model.embed_tokens.weight"])
    assert json.loads((tmp_path / "awq" / "config.json").read_text())["dtype"] == "bfloat16"
    # `quantkit quality` reads the peer's checkpoint (quantize.peer_fake_quant): KL and block SNR; no per-projection
    # SNR, since the AWQ scales in its norms are not recorded (its projections' inputs are not the source's). Sanity
    # bound, not a measurement: NVFP4 rounds each element to within 1/4 of its group's scale step, so a block's
    # output noise stays well under its signal (SNR > 6 dB); a global scale read inverted (~1e4 off) is far below.
    _, (awq_quality,) = quality_table(llama, [tmp_path / "awq"], num_sequences=4, seq_len=64)
    layers = json.loads((llama / "config.json").read_text())["num_hidden_layers"]
    assert awq_quality["recipe"] == "awq" and awq_quality["layer_snr_db"] == {} and awq_quality["kl"] > 0
    blocks = {f"model.layers.{i}.{b}" for i in range(layers) for b in ("self_attn", "mlp")}
    assert set(awq_quality["block_snr_db"]) == blocks
    assert all(db > 6 for db in awq_quality["block_snr_db"].values()), awq_quality["block_snr_db"]

    # AWQ then GPTQ (recipe nvfp4_ct_awq_gptq): both run, in that order, on one set of windows (GPTQ's); the peer's
    # own record of what it ran (recipe.yaml) lists them, and AWQ's scales are folded into the norms as above
    awq_gptq = parse_recipe(
        {**peer, "name": "awq_gptq", "gptq": small, "peer_modifiers": {"AWQModifier": {"n_grid": 5}}}
    )
    assert [s["use"] for s in calibration_sets(awq_gptq)] == ["awq and gptq and activation scales"]
    out = quantize_checkpoint(llama, awq_gptq, tmp_path / "awq_gptq")
    ran = yaml.safe_load((out / "recipe.yaml").read_text())["default_stage"]["default_modifiers"]
    assert list(ran) == ["AWQModifier", "GPTQModifier"] and ran["GPTQModifier"]["scheme"] == "NVFP4"
    state = load_file(out / "model.safetensors")
    assert any(not torch.equal(state[k], src[k]) for k in norms), "AWQ folded no scales into any norm"

    spin = parse_recipe(
        {
            **peer,
            "name": "spin",
            "gptq": small,
            "peer_modifiers": {"SpinQuantModifier": {"rotations": ["R1", "R2"], "transform_block_size": 16}},
        }
    )
    out = quantize_checkpoint(llama, spin, tmp_path / "spin")
    config = json.loads((out / "config.json").read_text())
    locations = {
        a["location"]
        for g in config["quantization_config"]["transform_config"]["config_groups"].values()
        for a in g["apply"]
    }
    assert locations == {"weight_input", "weight_output"}  # folded: nothing for vLLM to apply online
    assert config["tie_word_embeddings"] is False
    embed = src["model.embed_tokens.weight"].float()
    embed = embed - embed.mean(-1, keepdim=True)  # SpinQuant centers the embedding rows first
    rotated = load_file(out / "model.safetensors")["model.embed_tokens.weight"].float()
    # each output is a sum of 16 products +-e/4: float32 rounding of our centering and transform, and of the peer's
    # float64 result, each ~2**-24 relative per term: 16 terms bound that difference by 2**-20 x max|e|; the peer's
    # result is then stored in the source's bfloat16, rounding each element by <= 2**-8 of itself (the unit
    # roundoff of its 8-bit significand), so |ours - stored| <= 2**-8 |ours| + (1 + 2**-8) 2**-20 max|e|, under
    # 2**-8 |ours| + 2**-19 max|e|
    ours = block_hadamard(embed, 16)
    assert ((ours - rotated).abs() <= 2.0**-8 * ours.abs() + 2.0**-19 * embed.abs().max()).all()

    with pytest.raises(BackendError, match=r"sequential pipeline.*'quantkit'"):
        quantize_checkpoint(source, dataclasses.replace(awq, name="awq_zoo"), tmp_path / "awq_zoo")


def test_modelopt_search_algorithms_run_on_cpu(source, tmp_path):
    """ModelOpt 0.42's AWQ and MSE calibrations run without a GPU on quantkit.quantize.modelopt_cpu's transcriptions
    of its NVFP4 kernels (tests/test_modelopt_cpu.py checks them against ModelOpt's code): AWQ-lite exports
    NVFP4_AWQ with per-channel pre_quant_scale tensors (where a norm could not take them); MSE exports NVFP4 whose
    weight scales differ from max calibration's (its search moved them: the candidates, 0.25..4 x max in 0.1 steps,
    do not include 1 x max)."""
    from quantkit.quantize.recipe import load_recipe

    calibration = CalibrationSettings(num_sequences=4, seq_len=64)
    out = {}
    for name in ("nvfp4_modelopt", "nvfp4_modelopt_awq", "nvfp4_modelopt_mse"):
        recipe = dataclasses.replace(load_recipe(name), calibration=calibration)
        out[name] = quantize_checkpoint(source, recipe, tmp_path / name)
    algo = {n: json.loads((d / "config.json").read_text())["quantization_config"]["quant_algo"] for n, d in out.items()}
    assert algo == {"nvfp4_modelopt": "NVFP4", "nvfp4_modelopt_awq": "NVFP4_AWQ", "nvfp4_modelopt_mse": "NVFP4"}
    awq = load_file(out["nvfp4_modelopt_awq"] / "model.safetensors")
    assert any(key.endswith(".pre_quant_scale") for key in awq)
    plain, mse = (load_file(out[n] / "model.safetensors") for n in ("nvfp4_modelopt", "nvfp4_modelopt_mse"))
    scales = [k for k in plain if k.endswith(".weight_scale")]
    assert scales and any(not torch.equal(plain[k].view(torch.uint8), mse[k].view(torch.uint8)) for k in scales)


def test_modelopt_cannot_export_its_fp8_scale_sweep(source, tmp_path):
    """Why recipes refuse ModelOpt's `mse: {fp8_scale_sweep: true}` (recipe._modelopt_mse_check): the sweep searches
    stored per-group scales, so it needs static NVFP4 weight blocks, and ModelOpt 0.42's export reads such a
    quantizer's per-group amax as the per-tensor one and fails. When this test fails, ModelOpt can export the sweep
    and the refusal should go."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    from quantkit.models.attention import load_reference_model
    from quantkit.quantize.modelopt_backend import _cpu_safe_fp4_check
    from quantkit.quantize.modelopt_cpu import modelopt_fp4_on_cpu
    from quantkit.quantize.recipe import parse_recipe

    sweep = {"mse": {"fp8_scale_sweep": True}}
    with pytest.raises(ValueError, match=r"fp8_scale_sweep is not supported.*static NVFP4 weight blocks"):
        parse_recipe({"name": "x", "backend": "modelopt", "scheme": "NVFP4", "peer_modifiers": sweep})
    model = load_reference_model(source, torch.bfloat16)
    config = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    config["quant_cfg"]["*weight_quantizer"]["block_sizes"] = {-1: 16, "type": "static", "scale_bits": (4, 3)}
    config["algorithm"] = {"method": "mse", "fp8_scale_sweep": True}
    tokens = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))

    def forward_loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for row in tokens:
                m(row[None])

    with _cpu_safe_fp4_check(), modelopt_fp4_on_cpu():
        mtq.quantize(model, config, forward_loop)
        with pytest.raises(RuntimeError, match="must match the size"):
            export_hf_checkpoint(model, export_dir=str(tmp_path / "out"))


def test_modelopt_export(source, tmp_path):
    """ModelOpt's presets export from CPU; NVFP4 weights bit-exact with ours at ModelOpt's global scale;
    FP8 per-channel weights bit-exact with our per-row FP8; the ignore list stays unquantized."""
    from quantkit.formats import quantize_fp8_per_token, quantize_nvfp4
    from quantkit.quantize.recipe import parse_recipe

    w = load_file(source / "model.safetensors")
    calibration = {"num_sequences": 4, "seq_len": 64}
    nvfp4 = parse_recipe(
        {"name": "nvfp4_modelopt", "backend": "modelopt", "scheme": "NVFP4", "calibration": calibration}
    )
    out = quantize_checkpoint(source, nvfp4, tmp_path / "nvfp4_mo")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "modelopt" and config["quant_algo"] == "NVFP4"
    state = load_file(out / "model.safetensors")
    checked = 0
    for key, weight in w.items():
        module = key.removesuffix(".weight")
        if f"{module}.weight_scale_2" not in state:
            continue
        assert state[f"{module}.input_scale"].item() > 0  # static calibrated activation global scale
        ours = quantize_nvfp4(weight.to(torch.bfloat16), state[f"{module}.weight_scale_2"].float().reshape(()))
        assert torch.equal(state[f"{module}.weight"], ours.packed), module
        assert torch.equal(state[f"{module}.weight_scale"].view(torch.uint8), ours.block_scale.view(torch.uint8)), (
            module
        )
        checked += 1
    layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    assert checked == layers * 8  # q, k, v, o, g_proj, gate, up, down per layer
    for ignored in ("lm_head", "model.layers.0.input_layernorm.gate_down"):
        assert state[f"{ignored}.weight"].dtype == torch.bfloat16 and f"{ignored}.weight_scale" not in state

    fp8 = parse_recipe(
        {"name": "fp8_mo", "backend": "modelopt", "scheme": "FP8_PER_CHANNEL_PER_TOKEN", "calibration": calibration}
    )
    out = quantize_checkpoint(source, fp8, tmp_path / "fp8_mo")
    state = load_file(out / "model.safetensors")
    name = "model.layers.1.mlp.down_proj"
    q, scale = quantize_fp8_per_token(w[f"{name}.weight"].to(torch.bfloat16))
    assert torch.equal(state[f"{name}.weight"].view(torch.uint8), q.view(torch.uint8))
    # both are amax / 448 of the same bf16 row, each one float32 rounding (<= 2**-24 relative) from exact
    assert torch.allclose(state[f"{name}.weight_scale"].float().reshape(-1), scale.reshape(-1), rtol=1e-6)


@pytest.mark.parametrize(
    "architecture", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phi3", "gemma2", "gemma3"]
)
def test_stock_decoders_quantize_with_every_scheme_and_smoothquant(architecture, tmp_path):
    """The decoders transformers ships (issue 28), tiny and random: FP8 block and NVFP4 checkpoints whose fake-quant
    reference loads, and SmoothQuant (table entry or the traced structural rule; `quantize` raises unless the fold
    preserves the function, relative logit change <= its tolerance)."""
    from quantkit.models.tiny import build_tiny_stock_checkpoint

    source = build_tiny_stock_checkpoint(tmp_path / architecture, architecture)
    recipe = tmp_path / "sq_tiny.yaml"
    recipe.write_text("name: sq_tiny\nscheme: nvfp4\nsmoothquant: {alpha: 0.5, num_sequences: 2, seq_len: 16}\n")
    for name in ("w8a8_fp8_block", "w4a4_nvfp4", str(recipe)):
        out = quantize_checkpoint(source, name, tmp_path / Path(name).stem, streaming=False)
        model = load_fake_quant_model(out)
        assert any(isinstance(m, FakeQuantLinear) for m in model.modules())
        with torch.no_grad():
            assert torch.isfinite(model(torch.tensor([[1, 2, 3, 4]])).logits).all()
    report = json.loads((out / "smoothquant.json").read_text())
    assert report["mappings"] and report["relative_logit_change"] <= report["tolerance"]
    # one layer at a time (SmoothQuant's traced rule on the meta skeleton included): the same tensors and report
    from quantkit.checkpoints import read_state

    streamed_dir = quantize_checkpoint(source, str(recipe), tmp_path / "streamed", streaming=True)
    streamed, whole = read_state(streamed_dir), read_state(out)
    assert streamed.keys() == whole.keys() and all(torch.equal(streamed[k], whole[k]) for k in whole)
    assert (streamed_dir / "smoothquant.json").read_text() == (out / "smoothquant.json").read_text()


def test_every_nvfp4_method_quantizes_gemma3(tmp_path):
    """Issue 51 item 6: each NVFP4 method runs on Gemma 3 (four (1 + w) norms a layer, sandwich post-norms, tied
    head) and its checkpoint loads in the fake-quant reference with finite logits: AWQ with v -> o and up -> down
    (`SANDWICH` table entry; the fold's function check raises otherwise), Four Over Six, the online Hadamard of 16
    at every input with GPTQ (a residual rotation Gemma 3 refuses by reason; with MSE scales: test_rotation) and the
    bit budget. Each method's numerics are tested on its own (test_awq, test_gptq, test_rotation, test_bit_budget,
    ...); tiny calibration (2 x 32 tokens)."""
    from quantkit.diagnose.budget import resolve_bit_budget
    from quantkit.models.tiny import build_tiny_stock_checkpoint
    from quantkit.quantize.recipe import parse_recipe

    source = build_tiny_stock_checkpoint(tmp_path / "gemma3", "gemma3", seed=0)
    small = {"num_sequences": 2, "seq_len": 32}
    awq = {"scales": "awq", **small}
    recipes = [
        {"name": "awq", "scheme": "nvfp4", "smoothquant": {**awq, "include_v_o": True, "include_up_down": True}},
        {"name": "w46", "scheme": "nvfp4_four_over_six", "weight_scales": "four_over_six"},
        {"name": "had16_gptq", "scheme": "nvfp4", "rotation": {"block": 16, "residual": False}, "gptq": small},
        {"name": "budget", "scheme": "nvfp4", "bit_budget": {"avg_bits": 5.0, **small}},
    ]
    for data in recipes:
        recipe = resolve_bit_budget(source, parse_recipe(data), progress=False)
        out = quantize_checkpoint(source, recipe, tmp_path / data["name"], streaming=False)
        model = load_fake_quant_model(out)
        assert any(isinstance(m, FakeQuantLinear) for m in model.modules()), data["name"]
        with torch.no_grad():
            assert torch.isfinite(model(torch.tensor([[1, 2, 3, 4]])).logits).all(), data["name"]
