"""Same-process A/B of quantkit's CPU speed-ups for served hybrid checkpoints (benchmarks/README.md, "Hybrid MoE").

"before" = vLLM's own CPU paths: the per-sequence prefill conv (`causal_conv1d_fn_cpu`), the C++ prefill delta rule
(`chunk_gated_delta_rule_cpu`), bf16 `F.linear` for unquantized Linears, and one expert-activation quantizer call per
expert; "after" = quantkit's: `gdn_cpu.causal_conv1d_prefill`, `gdn_cpu.chunk_gated_delta_rule_prefill`,
`cpu_linear` (float32 compute) and one quantizer call per layer and input. One engine, alternating before / after
REPS times on two workloads: prefill (PROMPTS prompts of ~PROMPT_WORDS words, one token, prompt logprobs: lm-eval's
log-likelihood shape) and generate (the same prompts, MAX_TOKENS greedy tokens); tokens/s of each and whether the
greedy tokens agree.
Usage: python benchmarks/ab_hybrid_cpu.py CHECKPOINT_DIR [--prompts 32] [--prompt-words 150] [--max-tokens 64]
[--reps 2]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from quantkit.data import heldout_texts
from quantkit.serve.engine import cpu_engine_kwargs, offline_environment


def set_linears(model: torch.nn.Module, ours: bool) -> int:
    """Point every Linear that `cpu_linear` switched to float32 at ours (True) or at bf16 `F.linear` on the same
    (exactly bf16) weights, vLLM's own fallback (False); returns how many."""
    count = 0
    for module in model.modules():
        linear = getattr(module, "quantkit_float32_linear", None) or getattr(module, "cpu_linear", None)
        if getattr(linear, "weight32", None) is None:
            continue
        module.quantkit_float32_linear = linear
        if ours:
            module.cpu_linear = linear
        else:
            weight = linear.weight32.bfloat16()
            bias = None if linear.bias32 is None else linear.bias32.bfloat16()
            module.cpu_linear = lambda x, _w, _b, weight=weight, bias=bias: F.linear(x, weight, bias)
        count += 1
    return count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=150)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args()
    offline_environment()
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.mamba.ops.cpu import causal_conv1d, gdn_attention

    from quantkit.serve import moe_method
    from quantkit.serve.cpu import gdn as gdn_cpu

    batched = moe_method.QuantkitExperts._fake_quant
    vllm_delta_rule = torch.ops._C.chunk_gated_delta_rule_cpu

    def per_expert_calls(self, rows, segments, which):  # one quantizer call per expert, as before
        return torch.cat([batched(self, rows[a:b], [(e, 0, b - a)], which) for e, a, b in segments])

    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        max_model_len=1024,
        seed=0,
        enable_prefix_caching=False,
        **cpu_engine_kwargs(),
    )
    words = " ".join(heldout_texts()).split()
    n = args.prompt_words
    prompts = [" ".join(words[i * n : (i + 1) * n]) for i in range(args.prompts)]
    workloads = {
        "prefill": SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
        "generate": SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
    }
    llm.generate(["warm-up"], SamplingParams(max_tokens=2), use_tqdm=False)
    print("Linears switched to float32 by cpu_linear:", llm.apply_model(lambda m: set_linears(m, True))[0])
    tokens = {}
    try:
        for rep in range(args.reps):
            for name, ours in (("before", False), ("after", True)):
                gdn_attention.causal_conv1d_torch = (
                    gdn_cpu.causal_conv1d_prefill if ours else causal_conv1d.causal_conv1d_fn_cpu
                )
                gdn_attention.ops.chunk_gated_delta_rule_cpu = (
                    gdn_cpu.chunk_gated_delta_rule_prefill if ours else vllm_delta_rule
                )
                moe_method.QuantkitExperts._fake_quant = batched if ours else per_expert_calls
                llm.apply_model(lambda m, ours=ours: set_linears(m, ours))
                for workload, params in workloads.items():
                    start = time.perf_counter()
                    out = llm.generate(prompts, params, use_tqdm=False)
                    seconds = time.perf_counter() - start
                    prompt_tokens = sum(len(o.prompt_token_ids) for o in out)
                    generated = sum(len(o.outputs[0].token_ids) for o in out)
                    if workload == "generate":
                        tokens.setdefault(name, []).append([o.outputs[0].token_ids for o in out])
                    rate = prompt_tokens / seconds if workload == "prefill" else generated / seconds
                    unit = "prompt tokens/s" if workload == "prefill" else "generated tokens/s"
                    print(
                        f"{name} rep{rep} {workload}: {prompt_tokens} prompt + {generated} generated tokens "
                        f"{seconds:.2f} s {rate:.1f} {unit} load1 {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
    finally:
        llm.llm_engine.engine_core.shutdown()
    same = sum(a == b for a, b in zip(tokens["before"][0], tokens["after"][0]))
    print(f"greedy tokens identical before/after: {same} of {len(prompts)} prompts")


if __name__ == "__main__":
    main()
