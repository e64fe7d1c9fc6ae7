"""Same-process A/B of quantkit's two CPU speed-ups for served hybrid checkpoints (benchmarks/README.md, "Hybrid MoE").

"before": vLLM's per-sequence prefill conv (`causal_conv1d_fn_cpu`) and one expert-activation quantizer call per
expert; "after": `quantkit.serve.gdn_cpu.causal_conv1d_prefill` and one call per layer and input. One engine,
alternating before / after REPS times on bench_serve.py's prompts; tokens/s of each `llm.generate` and whether
the greedy tokens agree. Usage: python benchmarks/ab_hybrid_cpu.py CHECKPOINT_DIR [--prompts 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from quantkit.data import heldout_texts
from quantkit.serve.engine import cpu_engine_kwargs, offline_environment


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=1)
    args = p.parse_args()
    offline_environment()
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.mamba.ops.cpu import causal_conv1d, gdn_attention

    from quantkit.serve import moe_method
    from quantkit.serve.gdn_cpu import causal_conv1d_prefill

    batched = moe_method.QuantkitExperts._fake_quant

    def per_expert_calls(self, rows, segments, which):  # one quantizer call per expert, as before
        return torch.cat([batched(self, rows[a:b], [(e, 0, b - a)], which) for e, a, b in segments])

    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=1024, seed=0, **cpu_engine_kwargs())
    words = " ".join(heldout_texts()).split()
    prompts = [" ".join(words[i * 48:(i + 1) * 48]) for i in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(["warm-up"], SamplingParams(max_tokens=2), use_tqdm=False)
    tokens = {}
    try:
        for rep in range(args.reps):
            for name, conv, quantizer in (("before", causal_conv1d.causal_conv1d_fn_cpu, per_expert_calls),
                                          ("after", causal_conv1d_prefill, batched)):
                gdn_attention.causal_conv1d_torch = conv
                moe_method.QuantkitExperts._fake_quant = quantizer
                start = time.perf_counter()
                out = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                n = sum(len(o.outputs[0].token_ids) for o in out)
                tokens.setdefault(name, []).append([o.outputs[0].token_ids for o in out])
                print(f"{name} rep{rep}: {n} tokens {seconds:.2f} s {n / seconds:.1f} tokens/s "
                      f"load1 {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
    print("same tokens before/after:", tokens["before"][0] == tokens["after"][0])


if __name__ == "__main__":
    main()
