"""Quantized checkpoints served by vLLM with `quant_method: "quantkit"` match the transformers fake-quant reference.

Per case (architecture x recipe x tensor parallel size): quantize a tiny float32 checkpoint, serve it once
with vLLM on CPU (prompt logprobs + greedy decoding, so prefill and KV-cache decode paths both run), and
compare the logprob of every token after the first with `load_fake_quant_model` over the same tokens.

Tolerance, per token logprob after the first (nats): most of them within 1e-4 of the reference
("exact": both sides decode the same weights and quantize activations with the same `quantkit.formats`
functions in float32, so only summation order differs, measured 0 to 5e-7): >= 90% of the tokens without
tensor parallelism, >= 75% with it; and all within 1e-3 without / 3e-2 with it. The looser TP bounds are
for isolated rounding-boundary flips: a ~1e-7 relative difference in an activation (vLLM's all-reduce sums
the rank partials in another order) moves an element across an E4M3 midpoint with probability ~1e-7/2**-4
per element, i.e. ~0.1 per token over ~10k quantized elements per token; a flip is one code step (1/16
relative). Measured at TP 2 (fp8_block): 89% of tokens exact, max 1.7e-2.

Control: the weight-only ablation (same decoded weights, activations NOT quantized) and the unquantized
source must be "exact" on fewer than half of the tokens: the quantized activation path really runs in
vLLM, and the check is not blind to it.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from quantkit.models.tiny import build_tiny_checkpoint, build_tiny_stock_checkpoint
from quantkit.quantize.checkpoint import quantize_checkpoint
from quantkit.quantize.fake_quant import load_fake_quant_model
from quantkit.serve.offline import generate, omp_bind_per_rank

pytestmark = pytest.mark.slow

PROMPTS = [
    "Return the number of items in a container.",
    "The logging module defines functions and classes which implement a flexible event logging system.",
]
DECODE_TOKENS = 4
EXACT = 1e-4              # float32 summation-order noise
MIN_EXACT_FRACTION = {1: 0.9, 2: 0.75}  # by tensor parallel size (rounding-boundary flips, see above)
MAX_DIFF = {1: 1e-3, 2: 3e-2}
CONTROL_MAX_EXACT_FRACTION = 0.5
VARIANT = dict(attn_output_gate="headwise", gated_norm_rank=16)  # GA + GatedNorm: the paper's best row

CASES = {  # name: (architecture, recipe, tensor parallel size)
    "ga_gatednorm-fp8_block": ("variant", "w8a8_fp8_block", 1),
    "ga_gatednorm-nvfp4": ("variant", "w4a4_nvfp4", 1),
    "ga_gatednorm-nvfp4_static": ("variant", "w4a4_nvfp4_static", 1),
    "qwen3-fp8_block": ("qwen3", "w8a8_fp8_block", 1),
    "qwen3-nvfp4": ("qwen3", "w4a4_nvfp4", 1),
    "ga_gatednorm-fp8_block-tp2": ("variant", "w8a8_fp8_block", 2),
    "ga_gatednorm-nvfp4_static-tp2": ("variant", "w4a4_nvfp4_static", 2),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {
        "variant": build_tiny_checkpoint(root / "variant", seed=0, **VARIANT),
        "qwen3": build_tiny_stock_checkpoint(root / "qwen3", "qwen3", seed=0),
    }


def reference_logprobs(model: torch.nn.Module, token_ids: list[list[int]]) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for ids in token_ids:
            logits = model(torch.tensor([ids])).logits[0].float()
            out.append(torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0])
    return out


def token_diffs(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(x - y).abs() for x, y in zip(a, b, strict=True)])


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_matches_fake_quant_reference(case, sources, tmp_path, caplog):
    architecture, recipe, tp = CASES[case]
    if tp > 1 and (omp_bind_per_rank(tp) is None or torch.cuda.is_available()):
        pytest.skip(f"tensor parallelism {tp} on CPU needs {tp} cores")
    source = sources[architecture]
    quantized = quantize_checkpoint(source, recipe, tmp_path / recipe)
    tok = AutoTokenizer.from_pretrained(quantized)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    run = generate(quantized, prompts, max_tokens=DECODE_TOKENS, tensor_parallel_size=tp, max_model_len=256, dtype="float32")
    token_ids = [g.token_ids for g in run.generations]
    served = [torch.tensor(g.logprobs) for g in run.generations]
    assert all(len(g.token_ids) == len(p) + DECODE_TOKENS for g, p in zip(run.generations, prompts))

    from transformers import AutoModelForCausalLM

    parity = token_diffs(served, reference_logprobs(load_fake_quant_model(quantized), token_ids))
    weight_only = token_diffs(served, reference_logprobs(load_fake_quant_model(quantized, quantize_activations=False), token_ids))
    source_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    unquantized = token_diffs(served, reference_logprobs(source_model, token_ids))
    exact = {k: (d <= EXACT).float().mean().item() for k, d in [("parity", parity), ("weight_only", weight_only), ("unquantized", unquantized)]}
    print(f"{case}: {len(parity)} tokens; parity: {exact['parity']:.0%} exact, max {parity.max():.1e}; weight-only: "
          f"{exact['weight_only']:.0%} exact, max {weight_only.max():.3f}; unquantized: {exact['unquantized']:.0%} exact, max {unquantized.max():.3f}")
    assert exact["parity"] >= MIN_EXACT_FRACTION[tp], f"{case}: only {exact['parity']:.0%} of tokens match the fake-quant reference"
    assert parity.max() <= MAX_DIFF[tp], f"{case}: vLLM differs from the fake-quant reference by {parity.max():.2e} nats"
    assert exact["weight_only"] < CONTROL_MAX_EXACT_FRACTION, f"{case}: the weight-only model matches too: activations not quantized?"
    assert exact["unquantized"] < CONTROL_MAX_EXACT_FRACTION


def test_checkpoint_errors(sources, tmp_path):
    """Missing / inconsistent / malformed quantization configs are refused before vLLM starts, naming the problem."""
    from safetensors.torch import load_file, save_file

    from quantkit.serve.checkpoint_check import CheckpointError, check_servable

    good = quantize_checkpoint(sources["variant"], "w4a4_nvfp4", tmp_path / "good")
    assert check_servable(good)["scheme"] == "nvfp4"
    assert check_servable(sources["variant"]) is None

    def variant(name, edit_config=None, edit_state=None):
        import shutil

        bad = tmp_path / name
        shutil.copytree(good, bad)
        config = json.loads((bad / "config.json").read_text())
        if edit_config:
            edit_config(config)
        (bad / "config.json").write_text(json.dumps(config))
        if edit_state:
            state = load_file(bad / "model.safetensors")
            edit_state(state)
            save_file(state, bad / "model.safetensors")
        return bad

    module = "model.layers.0.mlp.down_proj"
    cases = [
        (variant("no_config", lambda c: c.pop("quantization_config")), "no quantization_config"),
        (variant("bad_version", lambda c: c["quantization_config"].update(format_version=7)), "format_version 7"),
        (variant("bad_scheme", lambda c: c["quantization_config"].update(scheme="int3")), "scheme 'int3'"),
        (variant("fp8_claimed", lambda c: c["quantization_config"].update(scheme="fp8_block")), "has no tensor .*weight"),
        (variant("missing_scale", edit_state=lambda s: s.pop(f"{module}.weight_global_scale")), "no tensor .*weight_global_scale"),
        (variant("bad_shape", edit_state=lambda s: s.update({f"{module}.weight_scale": s[f"{module}.weight_scale"][:, :3].contiguous()})),
         "weight_scale has shape"),
        (variant("unlisted", lambda c: c["quantization_config"]["quantized_modules"].remove(module)), "not in quantization_config"),
    ]
    for bad, message in cases:
        with pytest.raises(CheckpointError, match=message):
            check_servable(bad)
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "config.json").write_text("{}")
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="unreadable safetensors"):
        check_servable(tmp_path / "corrupt")
    with pytest.raises(CheckpointError, match="no config.json"):
        check_servable(tmp_path / "nothing")


def test_quantkit_serve_openai_server(sources, tmp_path):
    """`quantkit serve` starts vLLM's OpenAI server on a quantized checkpoint; its greedy completion equals offline
    generation, and the engine log names the quant method and kernel of every quantized layer."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    quantized = quantize_checkpoint(sources["variant"], "w4a4_nvfp4", tmp_path / "nvfp4")
    offline = generate(quantized, [PROMPTS[0]], max_tokens=8, max_model_len=256, with_logprobs=False).generations[0].text
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "server.log"
    command = [str(Path(sys.executable).parent / "quantkit"), "serve", str(quantized), "--port", str(port), "--max-model-len", "256"]
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, "server did not come up:\n" + log.read_text()[-3000:]
                time.sleep(2)
        body = json.dumps({"model": str(quantized), "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body.encode(), {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert reply["choices"][0]["text"] == offline
    finally:
        server.terminate()
        server.wait(timeout=60)
    text = log.read_text()
    assert "quant_method quantkit, recipe w4a4_nvfp4, scheme nvfp4" in text
    assert "quantkit: model.layers.0.self_attn.qkv_proj scheme=nvfp4 activations=per_token kernel=torch-emulation" in text


def test_cli_refuses_bad_checkpoints(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "config.json").write_text("{}")
    quantkit = Path(sys.executable).parent / "quantkit"
    for command in ("serve", "generate"):
        run = subprocess.run([str(quantkit), command, str(tmp_path)] + (["hi"] if command == "generate" else []), capture_output=True, text=True)
        assert run.returncode == 2 and "no *.safetensors weights" in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("recipe, kernel", [("fp8_block_ct", "EmulationFp8BlockScaledMMKernel"), ("nvfp4_ct", "EmulationNvFp4LinearKernel")])
def test_peer_checkpoints_served_on_cpu(recipe, kernel, sources, tmp_path, capfd):
    """The peers' compressed-tensors checkpoints (llmcompressor) are served on CPU by the emulation kernels the plugin
    registers; the log names the kernel; the output is quantized (differs from the source) but close to it."""
    from transformers import AutoModelForCausalLM

    from quantkit.quantize.recipe import load_recipe, parse_recipe

    settings = {k: v for k, v in vars(load_recipe(recipe)).items() if k in ("name", "scheme", "backend")}
    quantized = quantize_checkpoint(sources["variant"], parse_recipe({**settings, "calibration": {"num_sequences": 4, "seq_len": 64}}),
                                    tmp_path / recipe)
    assert json.loads((quantized / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    tok = AutoTokenizer.from_pretrained(quantized)
    run = generate(quantized, [tok(p)["input_ids"] for p in PROMPTS], max_tokens=DECODE_TOKENS, max_model_len=256, dtype="float32")
    assert f"Using {kernel}" in capfd.readouterr().out
    token_ids = [g.token_ids for g in run.generations]
    source = AutoModelForCausalLM.from_pretrained(sources["variant"], dtype=torch.float32).eval()
    diff = token_diffs([torch.tensor(g.logprobs) for g in run.generations], reference_logprobs(source, token_ids))
    print(f"{recipe}: {kernel}, |logprob - unquantized source| mean {diff.mean():.3f}, max {diff.max():.3f}")
    assert (diff <= EXACT).float().mean() < CONTROL_MAX_EXACT_FRACTION and diff.mean() < 0.5
