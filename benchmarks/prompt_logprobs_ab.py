"""Log-likelihood evaluation with vLLM's prompt log-probabilities over the whole prompt vs the continuation only.

    python benchmarks/prompt_logprobs_ab.py [--model smollm2-135m-instruct] [--tasks qk_arc_easy qk_hellaswag qk_piqa]
                                            [--limit 100] [--dtype bfloat16] [--rounds 2]

One engine (vLLM, quantkit's plugin), the same lm-eval tasks run alternately with `QUANTKIT_PROMPT_LOGPROBS=all`
(stock lm-eval: every prompt position's log-probability) and without it (quantkit's default: the continuation's
positions only, `quantkit.serve.prompt_logprobs`), `--rounds` times each. Prints, per mode, the lm-eval wall time of
each round and requests per second; the speed-up (median all / median continuation); and how far the two modes'
answers are apart: the largest difference of any choice's log-likelihood (nats) and the items whose chosen answer
differs (expected: none, or ties within rounding).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from quantkit.evals.harness import SCORED_POSITIONS_ENV, evaluate_tasks, open_lm
from quantkit.models import trained

TASKS_DIR = Path(__file__).resolve().parents[1] / "evals" / "tasks" / "mini"


def loglikelihoods(results: dict) -> dict[tuple[str, int], list[float]]:
    """(task, doc_id) -> each choice's log-likelihood (nats), from lm-eval's per-sample log."""
    out: dict[tuple[str, int], list[float]] = {}
    for task, samples in results["samples"].items():
        for sample in samples:
            out[(task, sample["doc_id"])] = [float(resp[0][0]) for resp in sample["resps"]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a trained model's name or a checkpoint dir")
    parser.add_argument("--tasks", nargs="+", default=["qk_arc_easy", "qk_hellaswag", "qk_piqa"])
    parser.add_argument("--limit", type=int, default=100, help="items per task")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternating")
    args = parser.parse_args()
    from lm_eval.tasks import TaskManager

    model = Path(args.model) if Path(args.model).is_dir() else trained.fetch(args.model)
    manager = TaskManager(include_path=str(TASKS_DIR))
    seconds: dict[str, list[float]] = {"all": [], "continuation": []}
    answers: dict[str, dict] = {}
    requests = 0
    with open_lm(model, "vllm", dtype=args.dtype, max_model_len=1024) as lm:
        for _ in range(args.rounds):
            for mode in ("all", "continuation"):
                os.environ[SCORED_POSITIONS_ENV] = mode
                start = time.perf_counter()
                results = evaluate_tasks(lm, args.tasks, manager, limit=args.limit)
                seconds[mode].append(time.perf_counter() - start)
                answers[mode] = loglikelihoods(results)
                requests = sum(len(v) for v in answers[mode].values())
                print(
                    f"{mode:>12}: {seconds[mode][-1]:7.1f} s  {requests / seconds[mode][-1]:6.2f} requests/s",
                    flush=True,
                )
    os.environ.pop(SCORED_POSITIONS_ENV, None)
    full, ours = answers["all"], answers["continuation"]
    gap = max(abs(a - b) for key in full for a, b in zip(full[key], ours[key], strict=True))
    flips = [
        k
        for k in full
        if max(range(len(full[k])), key=full[k].__getitem__) != max(range(len(ours[k])), key=ours[k].__getitem__)
    ]
    speedup = statistics.median(seconds["all"]) / statistics.median(seconds["continuation"])
    print(
        f"model {model.name}, tasks {' '.join(args.tasks)}, {args.limit} items each, {requests} requests, {args.dtype}"
    )
    print(f"speed-up (median all / median continuation): {speedup:.2f}x")
    print(f"largest log-likelihood difference: {gap:.3g} nats; items whose answer differs: {len(flips)} {flips[:5]}")


if __name__ == "__main__":
    main()
