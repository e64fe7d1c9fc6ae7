"""Every architecture variant served by vLLM (quantkit.serve.models) matches transformers (quantkit.models).

Per variant: build a tiny float32 checkpoint with the flag on, serve it once with vLLM on CPU (prompt
logprobs plus a few greedily decoded tokens, so the KV-cache path is covered too), and compare the
logprobs of every token after the first with the transformers forward over prompt + decoded tokens:
|diff| <= LOGPROB_ATOL = 1e-3 nats. Derived, not measured: float32 on both sides and no quantization, so the
gap is summation order only (vLLM's CPU kernels / oneDNN vs torch; ISA- and batch-shape-dependent), relative
~ lambda sqrt(K) u per dot product (u = 2**-24, Higham & Mary 2019; 1.4e-5 at K = 512, lambda = 10), a handful
of ops deep, and log_softmax moves a logprob by <= 2 max|d logit|: ~1e-4 at most, 10x inside the bound. No
discontinuity: the decoded tokens are vLLM's and transformers scores those same ids, so greedy choices cannot
diverge.

Control per flag: the transformers model with that flag switched off (same weights) must DIFFER from
vLLM by > CONTROL_MIN_DIFF = 1e-2 = 10 x LOGPROB_ATOL, which proves the flag is active in the checkpoint and
honoured by vLLM. Non-triviality: some prompt's reference logprobs vary by > 10 x LOGPROB_ATOL across tokens.
Both are properties of the fixed seeded weights, which are the same draw on every machine (torch.randn's AVX2
and scalar paths differ only in the last bit); on the transformers side (tiny checkpoints, seed 0) the smallest
control gap is 0.107 (GatedDyT) and the smallest spread 0.046 (GatedDyT): 10x and 4.6x above the bounds.

One checkpoint combines all flags that can be combined (RMSNorm family) and is served with tensor
parallelism 2, which checks the order of the attention-side flags and the per-rank sharding of g_proj
and of the KV-head parameters (v_scale_theta, sink_key, sink_value).

Prompts start with the BOS token at position 0 (the learnable sink overwrites position 0's key and value;
our tokenizers prepend it), passed to vLLM as token ids so both sides see exactly the same sequence.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import quantkit.models  # noqa: F401  (registers model_type "quantkit")
from quantkit.serve.engine import cpu_engine_kwargs

pytestmark = pytest.mark.slow

PROMPTS = [
    "Return the number of items in a container.",
    "The logging module defines functions and classes which implement a flexible event logging system.",
    "x = 1",
]
DECODE_TOKENS = 4
LOGPROB_ATOL = 1e-3  # parity: vLLM vs transformers, both float32
CONTROL_MIN_DIFF = 1e-2  # control: vLLM vs transformers with the flag switched off

ALL_RMSNORM_FLAGS = dict(
    attn_output_gate="elementwise",
    pre_affine=True,
    gated_norm_rank=16,
    hidden_act="sigmoid",
    value_scale=True,
    headwise_rmsnorm=True,
    attention_sink=True,
)

# name -> (config overrides of the checkpoint, overrides that switch the variant's own flag off or None,
#          tensor-parallel size)
VARIANTS: dict[str, tuple[dict, dict | None, int]] = {
    "baseline": ({}, None, 1),
    "ga_headwise": ({"attn_output_gate": "headwise"}, {"attn_output_gate": None}, 1),
    "ga_elementwise": ({"attn_output_gate": "elementwise"}, {"attn_output_gate": None}, 1),
    "ga_preaffine": ({"attn_output_gate": "headwise", "pre_affine": True}, {"pre_affine": False}, 1),
    "ga_gatednorm_r16": ({"attn_output_gate": "headwise", "gated_norm_rank": 16}, {"gated_norm_rank": 0}, 1),
    "glu": ({"hidden_act": "sigmoid"}, {"hidden_act": "silu"}, 1),
    "dyt": ({"norm_type": "dyt"}, {"norm_type": "rmsnorm"}, 1),
    "gated_dyt_r16": ({"norm_type": "dyt", "gated_norm_rank": 16}, {"gated_norm_rank": 0}, 1),
    "v_scale": ({"value_scale": True}, {"value_scale": False}, 1),
    "headwise_rmsnorm": ({"headwise_rmsnorm": True}, {"headwise_rmsnorm": False}, 1),
    "attention_sink": ({"attention_sink": True}, {"attention_sink": False}, 1),
    "all_rmsnorm_flags_tp2": (ALL_RMSNORM_FLAGS, None, 2),
}


def _omp_bind_per_rank(tp: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` CPU ranks ("0|1"), or None when there are fewer cores than ranks."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        return None
    per_rank = len(cores) // tp
    return "|".join(",".join(map(str, cores[r * per_rank : (r + 1) * per_rank])) for r in range(tp))


def served_logprobs(llm, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """DECODE_TOKENS greedy tokens after each prompt on vLLM engine `llm`, with the prompt's and the sampled tokens'
    logprobs -> (token_ids, logprobs): token_ids[i] = prompt i followed by its decoded tokens; logprobs[i][j] =
    vLLM's logprob of token_ids[i][j + 1]."""
    from vllm import SamplingParams

    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts],
        SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, prompt_logprobs=0, logprobs=0),
    )
    token_ids, logprobs = [], []
    for ids, out in zip(prompts, outputs):
        assert list(out.prompt_token_ids) == ids
        gen = out.outputs[0]
        lp = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
        lp += [gen.logprobs[j][t].logprob for j, t in enumerate(gen.token_ids)]
        token_ids.append(ids + list(gen.token_ids))
        logprobs.append(torch.tensor(lp))
    return token_ids, logprobs


@pytest.fixture(scope="module", params=list(VARIANTS))
def served(request, tmp_path_factory):
    """Build the variant's checkpoint, serve it once with vLLM; return token ids and vLLM's logprobs.

    `token_ids[i]` is prompt i followed by its greedily decoded tokens; `logprobs[i][j]` is vLLM's
    logprob of `token_ids[i][j + 1]` (prompt logprobs, then the decoded tokens' own logprobs).
    """
    from vllm import LLM

    from quantkit.models.tiny import build_tiny_checkpoint

    name = request.param
    overrides, control, tp = VARIANTS[name]
    env = {}
    if tp > 1:
        bind = _omp_bind_per_rank(tp)
        if bind is None or torch.cuda.is_available():
            pytest.skip(f"tensor parallelism {tp} on CPU needs {tp} cores")
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    ckpt = build_tiny_checkpoint(tmp_path_factory.mktemp(name) / "model", seed=0, **overrides)
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert tok.bos_token_id is not None
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    assert all(ids[0] == tok.bos_token_id for ids in prompts)

    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        llm = LLM(
            model=str(ckpt),
            dtype="float32",
            max_model_len=256,
            seed=0,
            tensor_parallel_size=tp,
            **cpu_engine_kwargs(),
        )
    try:
        assert llm.llm_engine.model_config.architectures == ["QuantkitForCausalLM"]
        assert llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == tp
        token_ids, logprobs = served_logprobs(llm, prompts)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return dict(name=name, ckpt=ckpt, token_ids=token_ids, logprobs=logprobs, control=control)


def hf_logprobs(ckpt, token_ids, **config_overrides) -> list[torch.Tensor]:
    """Logprob of each token after the first, from the transformers model (float32), one forward each."""
    config = AutoConfig.from_pretrained(ckpt)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(ckpt, config=config, dtype=torch.float32).eval()
    result = []
    with torch.no_grad():
        for ids in token_ids:
            logits = model(torch.tensor([ids])).logits[0].float()
            result.append(torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0])
    return result


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def test_vllm_matches_transformers(served):
    hf = hf_logprobs(served["ckpt"], served["token_ids"])
    worst = max_abs_diff(hf, served["logprobs"])
    print(f"\n{served['name']}: max |logprob diff| vLLM vs transformers = {worst:.2e}")
    # the logprobs vary across tokens by far more than the tolerance, so agreement is not trivial
    # (std measured on the tiny checkpoints: ~0.05 GatedDyT, ~0.1 DyT, ~0.4 GatedNorm, > 0.5 others)
    assert max(lp.std().item() for lp in hf) > 10 * LOGPROB_ATOL
    assert worst <= LOGPROB_ATOL, f"{served['name']}: max |logprob diff| {worst:.2e} > {LOGPROB_ATOL}"


@pytest.mark.parametrize("served", [name for name, (_, control, _) in VARIANTS.items() if control], indirect=True)
def test_flag_is_active(served):
    """Control: switching the variant's flag off in transformers moves its logprobs away from vLLM's."""
    hf_off = hf_logprobs(served["ckpt"], served["token_ids"], **served["control"])
    diff = max_abs_diff(hf_off, served["logprobs"])
    print(f"\n{served['name']}: max |logprob diff| vLLM vs transformers{served['control']} = {diff:.2e}")
    assert diff > CONTROL_MIN_DIFF, f"{served['name']}: flag {served['control']} looks inactive ({diff:.2e})"
