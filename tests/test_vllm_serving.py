"""vLLM on CPU serves a tiny quantkit checkpoint through quantkit's plugin, matching transformers.

Tolerance (derived, not measured): both sides run in float32 without quantization, so they differ only by
summation order (vLLM's CPU kernels and oneDNN GEMMs on fused weights vs torch ops; the order depends on the
machine's ISA and the batch shape). A length-K dot product carries a relative error ~ lambda sqrt(K) u
(u = 2**-24; Higham & Mary 2019: 1.4e-5 at K = 512, lambda = 10); a handful of such ops precede each logit of
this 2-layer model, and log_softmax moves a logprob by at most 2 max|d logit|: ~1e-4 at most, so
|diff| <= LOGPROB_ATOL = 1e-3 nats holds on every machine with 10x to spare. There is no discontinuity (no
quantization; the tokens are fixed), so no flip can occur. Non-triviality: the reference logprobs must vary
across tokens by more than 10 x LOGPROB_ATOL (they vary by ~0.8 on the tiny checkpoint), so that agreement
within the tolerance is not the agreement of two near-constant outputs.
"""

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantkit.models  # noqa: F401
from quantkit.serve.engine import cpu_engine_kwargs
from quantkit.serve.plugin import TRACE_ENV

PROMPTS = [
    "Return the number of items in a container.",
    "The logging module defines functions and classes which implement a flexible event logging system.",
    "x",
]
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def vllm_run(tiny_checkpoint, tmp_path_factory):
    """Serve the checkpoint once with vLLM's offline LLM API; return prompt logprobs and plugin pids."""
    from vllm import LLM, SamplingParams

    trace = tmp_path_factory.mktemp("plugin") / "pids.txt"
    with pytest.MonkeyPatch.context() as env:
        env.setenv(TRACE_ENV, str(trace))
        # vLLM's default engine-core process, as `quantkit serve` runs it (quantkit's offline CPU default keeps
        # the engine core in the calling process, quantkit.serve.engine)
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        llm = LLM(model=str(tiny_checkpoint), dtype="float32", max_model_len=256, seed=0, **cpu_engine_kwargs())
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
        arch = llm.llm_engine.model_config.architectures
    logprobs = []
    for out in outputs:
        ids = out.prompt_token_ids
        logprobs.append([None] + [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    pids = {int(line) for line in trace.read_text().split()}
    llm.llm_engine.engine_core.shutdown()
    return dict(logprobs=logprobs, token_ids=[o.prompt_token_ids for o in outputs], pids=pids, arch=arch)


def test_prompt_logprobs_match_transformers(tiny_checkpoint, vllm_run):
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    worst = 0.0
    for prompt, ids, vllm_lp in zip(PROMPTS, vllm_run["token_ids"], vllm_run["logprobs"]):
        assert ids == tok(prompt)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        hf_lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        diff = (hf_lp - torch.tensor(vllm_lp[1:])).abs()
        worst = max(worst, diff.max().item() if len(diff) else 0.0)
        # the random model is far from uniform, so agreement is not trivial (see the module docstring)
        if len(ids) > 4:
            assert hf_lp.std() > 10 * LOGPROB_ATOL
    assert worst <= LOGPROB_ATOL, f"max |logprob diff| {worst:.2e} > {LOGPROB_ATOL}"


def test_plugin_ran_inside_the_engine_process(vllm_run):
    assert vllm_run["arch"] == ["QuantkitForCausalLM"]
    engine_pids = vllm_run["pids"] - {os.getpid()}
    assert engine_pids, f"plugin ran only in the test process {os.getpid()}: {vllm_run['pids']}"


def test_without_the_plugin_vllm_cannot_load_the_checkpoint(tiny_checkpoint):
    """Control: with VLLM_PLUGINS="" the same checkpoint fails, even with our config class registered.

    The launching process imports quantkit.models (so transformers knows model_type "quantkit"); what
    is missing is the plugin's architecture registration, which only the entry point provides.
    """
    code = (
        "import quantkit.models\n"
        "from vllm import LLM\n"
        "from quantkit.serve.engine import cpu_engine_kwargs\n"
        f"LLM(model={str(tiny_checkpoint)!r}, dtype='float32', max_model_len=256, **cpu_engine_kwargs())\n"
    )
    env = dict(os.environ, VLLM_PLUGINS="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "QuantkitForCausalLM" in out.stderr and "not supported" in out.stderr, out.stderr[-2000:]
