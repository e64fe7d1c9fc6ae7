"""Evaluation suites (configs/suites/*.yaml) run through lm-eval, with stamped results and per-sample logs.

    evaluate(model_dir, suite="mini", backend="vllm", out_dir=..., limit=None, allow_code=False) -> dict

Suites: `smoke` (CI: 4 items of one task per benchmark, 32 generated tokens), `mini` (the offline
items extracted by `make setup`), `table2` (paper 000 Table 2 under a pinned protocol, docs/protocol.md;
needs the hub; `full` is an alias of it). A suite maps Table 2 benchmark names to lm-eval tasks;
benchmarks listed under `code` execute model output and run only with `allow_code=True`. Optional:
`avg` (the benchmarks the report's Avg is over; default all) and `protocol` (per benchmark: num_fewshot,
cot, generation_kwargs, metric, filter, source; the scored metric/filter is then that one, and
tests/test_protocol.py checks the rest against the built tasks). A suite file holding only `alias: NAME`
loads NAME. Each task is its own `simple_evaluate` call on one open engine (per-task timings).

out_dir receives, each written atomically:
    results.json          stamp (model, recipe, suite + version, backend, seeds, versions, date),
                          per-benchmark and per-task scores, seconds, truncated prompts, and with
                          `heldout_logprobs` what was recorded (file, mode, top_k, vocab_size, shape, seconds)
    samples/<task>.jsonl  one line per item: doc_id, score (the task's primary metric), answer (chosen
                          choice index, or the filtered generation), prompt, target, lm-eval's raw record
    heldout_logprobs.safetensors   with `heldout_logprobs` (vLLM only): the same engine's prompt logprobs of
                          the held-out KL windows, after the tasks (`quantkit.evals.degradation`)
Prompts longer than the context are cut from the left by lm-eval (the end of a prompt is kept, the BOS
and first tokens are lost); `truncated_prompts` counts them per task.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as metadata
import json
import logging
import os
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from quantkit.atomic import write_text_atomic
from quantkit.configs import SUITES_DIR
from quantkit.evals.execution import ALLOW_ENV
from quantkit.evals.extract import MissingExtractionError, data_dir, is_current
from quantkit.evals.harness import BACKENDS, EvalBackend
from quantkit.yamlfile import find_yaml, read_yaml, shipped_names

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
TASK_CONFIGS = {
    "mini": [TASKS_DIR / "mini"],
    "full": [TASKS_DIR / "mini", TASKS_DIR / "full"],
    "table2": [TASKS_DIR / "mini", TASKS_DIR / "full", TASKS_DIR / "table2"],
}
PROTOCOL_KEYS = {"num_fewshot", "cot", "generation_kwargs", "metric", "filter", "source"}
DEFAULT_SEED = 1234
MAX_CONTEXT = 4096  # default max_model_len cap: the checkpoint's max_position_embeddings when smaller


@dataclass
class Suite:
    """A validated suite file: Table 2 benchmark -> lm-eval tasks, and how to run them."""

    name: str
    version: int
    description: str
    task_configs: str
    benchmarks: dict[str, list[str]]
    code: list[str] = field(default_factory=list)
    limit: int | None = None
    gen_kwargs: dict[str, Any] = field(default_factory=dict)
    avg: list[str] | None = None
    protocol: dict[str, dict[str, Any]] = field(default_factory=dict)
    chat_template: bool = False  # render every prompt through the model's chat template (instruct-form tasks)

    def tasks(self, allow_code: bool) -> list[str]:
        """The lm-eval task names to run, in suite order, each once (a benchmark may pool the tasks of others);
        the `code` benchmarks' only with allow_code."""
        return list(
            dict.fromkeys(t for b, ts in self.benchmarks.items() if allow_code or b not in self.code for t in ts)
        )

    def benchmark_of(self, task: str) -> str:
        """The Table 2 benchmark (column) `task` belongs to."""
        return next(b for b, ts in self.benchmarks.items() if task in ts)

    def pinned_metric(self, task: str) -> tuple[str, str] | None:
        """(metric, filter) the protocol scores `task` by, or None without a protocol."""
        row = self.protocol.get(self.benchmark_of(task))
        return (row["metric"], row["filter"]) if row else None

    def record(self, limit: int | None, allow_code: bool) -> dict[str, Any]:
        """What results.json records of the suite a run used (`limit`: the items per task it ran)."""
        return dict(
            name=self.name,
            version=self.version,
            description=self.description,
            limit=limit,
            gen_kwargs=self.gen_kwargs,
            code_executed=allow_code,
            skipped_benchmarks=[b for b in self.code if not allow_code],
            avg=self.avg,
            chat_template=self.chat_template,
        )


def available_suites() -> list[str]:
    """The names of the shipped suites (configs/suites/*.yaml), sorted."""
    return shipped_names(SUITES_DIR)


def load_suite(name_or_path: str | Path) -> Suite:
    """A suite by name (SUITES_DIR/<name>.yaml) or YAML path; ValueError names the problem."""
    path = find_yaml(name_or_path, SUITES_DIR)
    if path is None:
        raise ValueError(
            f"unknown suite {str(name_or_path)!r}; known: {', '.join(available_suites())} (or a YAML path)"
        )
    raw = read_yaml(path)
    if isinstance(raw, dict) and raw.keys() == {"alias"}:
        return load_suite(raw["alias"])
    required = {"name", "version", "description", "task_configs", "benchmarks"}
    allowed = required | {"code", "limit", "gen_kwargs", "avg", "protocol", "chat_template"}
    if not isinstance(raw, dict) or required - raw.keys() or raw.keys() - allowed:
        raise ValueError(
            f"{path}: a suite needs keys {sorted(required)} (optional: code, limit, gen_kwargs, avg, "
            "protocol, chat_template), or only `alias`"
        )
    suite = Suite(**raw)
    if not isinstance(suite.chat_template, bool):
        raise ValueError(f"{path}: chat_template must be true or false")
    if suite.task_configs not in TASK_CONFIGS:
        raise ValueError(f"{path}: task_configs must be one of {sorted(TASK_CONFIGS)}")
    if not suite.benchmarks or not all(isinstance(v, list) and v for v in suite.benchmarks.values()):
        raise ValueError(f"{path}: benchmarks must map names to non-empty task lists")
    if unknown := set(suite.code) - suite.benchmarks.keys():
        raise ValueError(f"{path}: code lists unknown benchmarks {sorted(unknown)}")
    executed = {t for b in suite.code for t in suite.benchmarks[b]}
    if mixed := sorted(b for b, ts in suite.benchmarks.items() if b not in suite.code and executed & set(ts)):
        raise ValueError(f"{path}: benchmarks {mixed} hold tasks of `code` benchmarks: list them under code too")
    if suite.avg is not None and (not suite.avg or set(suite.avg) - suite.benchmarks.keys()):
        raise ValueError(f"{path}: avg must list some of the suite's benchmarks {sorted(suite.benchmarks)}")
    if suite.protocol and (
        suite.protocol.keys() != suite.benchmarks.keys()
        or any(set(row) != PROTOCOL_KEYS for row in suite.protocol.values())
    ):
        raise ValueError(f"{path}: protocol needs one row per benchmark, each with keys {sorted(PROTOCOL_KEYS)}")
    return suite


def model_stamp(model_dir: str | Path) -> dict[str, Any]:
    """What was evaluated: path, architecture, and the quantization recipe when the checkpoint has one."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    qc = config.get("quantization_config") or {}
    return dict(
        path=str(Path(model_dir).resolve()),
        name=Path(model_dir).resolve().name,
        architectures=config.get("architectures"),
        recipe=qc.get("recipe"),
        quant_method=qc.get("quant_method"),
        scheme=qc.get("scheme"),
    )


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("quantkit", "lm_eval", "vllm", "torch", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "missing"
    return out


@contextmanager
def _code_execution(allowed: bool) -> Iterator[None]:
    saved = os.environ.get(ALLOW_ENV)
    if allowed:
        os.environ[ALLOW_ENV] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ALLOW_ENV, None)
        else:
            os.environ[ALLOW_ENV] = saved


def _primary_metric(task_result: dict[str, Any], pinned: tuple[str, str] | None = None) -> tuple[str, str]:
    """(metric, filter): the suite protocol's `pinned` one, else the first reported (`acc,none` -> ("acc", "none"))."""
    if pinned is not None:
        if ",".join(pinned) not in task_result:
            raise ValueError(f"protocol metric {','.join(pinned)} not in lm-eval result {sorted(task_result)}")
        return pinned
    for key in task_result:
        if "," in key and "_stderr" not in key:
            metric, _, filt = key.partition(",")
            return metric, filt
    raise ValueError(f"no metric in lm-eval result {sorted(task_result)}")


def _sample_record(task: str, sample: dict[str, Any], metric: str) -> dict[str, Any]:
    resps = sample["filtered_resps"]
    if resps and isinstance(resps[0], (list, tuple)) and len(resps[0]) == 2 and isinstance(resps[0][1], bool):
        answer: Any = max(range(len(resps)), key=lambda i: resps[i][0])  # multiple choice: argmax log-likelihood
    else:
        answer = resps[0] if resps else None
    args = sample.get("arguments") or [[None]]
    return dict(
        task=task,
        doc_id=sample["doc_id"],
        score=sample.get(metric),
        answer=answer,
        prompt=args[0][0],
        target=sample.get("target"),
        lm_eval=sample,
    )


def _is_choice(records: list[dict[str, Any]]) -> bool:
    return bool(records) and isinstance(records[0]["answer"], int)


def _truncated(tokenizer: Any, records: list[dict[str, Any]], max_model_len: int, gen_budget: int) -> int:
    """Prompts whose tokens plus the generation budget exceed the context (lm-eval cuts them from the left)."""
    prompts = {r["prompt"] for r in records if isinstance(r["prompt"], str)}
    return sum(len(tokenizer(p)["input_ids"]) + gen_budget > max_model_len for p in prompts)


def _benchmark_scores(suite: Suite, tasks: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per benchmark: item-weighted mean of its tasks' primary metric."""
    out = {}
    for bench, names in suite.benchmarks.items():
        ran = [tasks[t] for t in names if t in tasks]
        if ran:
            n = sum(t["n"] for t in ran)
            score = sum(t["score"] * t["n"] for t in ran) / n if n else float("nan")
            out[bench] = dict(score=score, metric=ran[0]["metric"], n=n, tasks=[t for t in names if t in tasks])
    return out


def _tasks(spec: Suite, allow_code: bool) -> tuple[list[str], Any]:
    """The suite's lm-eval task names to run (the code benchmarks' only with `allow_code`, else a warning) and the
    TaskManager that knows them; ValueError naming tasks lm-eval does not know."""
    from lm_eval.tasks import TaskManager

    tasks = spec.tasks(allow_code)
    skipped = [b for b in spec.code if not allow_code]
    if skipped:
        logger.warning(
            "skipping %s: they execute model output; pass --allow-code-execution to run them", ", ".join(skipped)
        )
    task_manager = TaskManager(
        include_path=[str(p) for p in TASK_CONFIGS[spec.task_configs]], include_defaults=spec.task_configs != "mini"
    )
    if unknown := [t for t in tasks if t not in task_manager.all_tasks]:
        raise ValueError(f"suite {spec.name}: unknown lm-eval tasks {unknown}")
    return tasks, task_manager


def _tokenizer(spec: Suite, model_dir: Path) -> Any:
    """The model's tokenizer; ValueError if the suite renders prompts through a chat template it lacks."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if spec.chat_template and not tokenizer.chat_template:
        raise ValueError(
            f"suite {spec.name} renders its prompts through the model's chat template, and {model_dir} "
            "has none (an instruct model's tokenizer carries one: chat_template.jinja or "
            "tokenizer_config.json)"
        )
    return tokenizer


def evaluate(
    model_dir: str | Path,
    suite: str | Path = "mini",
    backend: str = "vllm",
    out_dir: str | Path | None = None,
    limit: int | None = None,
    allow_code: bool = False,
    seed: int = DEFAULT_SEED,
    max_model_len: int | None = None,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    heldout_logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run `suite` on `model_dir`; write results.json and samples/*.jsonl into out_dir (default
    runs/eval/<model>-<suite>); return the results dict. `limit` (items per task) overrides the suite's.
    `heldout_logprobs` ({num_sequences, seq_len, top_k}; vLLM backend, one engine replica): after the tasks, the
    same engine records the prompt logprobs of `heldout_windows` (`degradation.record_heldout_logprobs`; top_k
    None = full vocabulary). Bad input (suite, backend, checkpoint, missing offline items) raises before any
    engine starts."""
    from quantkit.evals.degradation import LOGPROBS_FILE, record_heldout_logprobs
    from quantkit.evals.harness import open_lm

    spec = load_suite(suite)
    model_dir = Path(model_dir)
    _check_inputs(model_dir, backend, heldout_logprobs, data_parallel_size)
    out_dir = (
        Path(out_dir) if out_dir is not None else Path("runs") / "eval" / f"{model_dir.resolve().name}-{spec.name}"
    )
    limit = limit if limit is not None else spec.limit
    config = json.loads((model_dir / "config.json").read_text())
    max_model_len = max_model_len or min(config.get("max_position_embeddings", MAX_CONTEXT), MAX_CONTEXT)
    tasks, task_manager = _tasks(spec, allow_code)
    tokenizer = _tokenizer(spec, model_dir)
    kl_tokens, max_logprobs = _kl_tokens(tokenizer, heldout_logprobs, max_model_len)

    run = _TaskRun(spec, task_manager, tokenizer, out_dir, limit, seed, allow_code, max_model_len)
    per_task: dict[str, dict[str, Any]] = {}
    recorded = None
    started = time.perf_counter()
    with (
        _code_execution(allow_code),
        open_lm(
            model_dir,
            backend,
            seed=seed,
            max_model_len=max_model_len,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size,
            max_logprobs=max_logprobs,
        ) as lm,
    ):
        startup = time.perf_counter() - started
        for task in (bar := tqdm(tasks, desc=f"eval {spec.name}", unit="task")):
            bar.set_postfix_str(task)
            per_task[task] = run.score(lm, task)
        if kl_tokens is not None and heldout_logprobs is not None:  # kl_tokens exist only with heldout_logprobs
            t0 = time.perf_counter()
            recorded = record_heldout_logprobs(
                lm.model, kl_tokens, out_dir / LOGPROBS_FILE, heldout_logprobs.get("top_k")
            )
            recorded["seconds"] = round(time.perf_counter() - t0, 2)
    results = dict(
        out_dir=str(out_dir.resolve()),
        model=model_stamp(model_dir),
        suite=spec.record(limit, allow_code),
        backend=backend,
        settings=dict(
            max_model_len=max_model_len,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size,
            decoding="greedy (temperature 0) unless the task says otherwise",
        ),
        seeds=dict(python=seed, numpy=seed, torch=seed, fewshot=seed, vllm=seed),
        versions=_versions(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        host=host_record(),
        seconds=dict(engine_startup=round(startup, 2), total=round(time.perf_counter() - started, 2)),
        benchmarks=_benchmark_scores(spec, per_task),
        tasks=per_task,
    )
    if recorded is not None:
        results["heldout_logprobs"] = recorded
    write_text_atomic(out_dir / "results.json", json.dumps(results, indent=1, default=str) + "\n")
    return results


def host_record() -> dict[str, Any]:
    """What decides this process's CPU summation order: machine, CPU model, core count, ATen's kernel capability
    (`torch.backends.cpu.get_cpu_capability()`: DEFAULT, AVX2, AVX512, ... as `ATEN_CPU_CAPABILITY` allows), the
    CPU's bf16/AMX flags, and the half-Linear summation order (`cpu_linear.summation_order`). Two evals whose records
    differ may differ in last bits, and so in greedy answers (docs/verdicts.md, "The numerics floor")."""
    import torch

    from quantkit.serve.engine import summation_order

    model, flags = "", set[str]()
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return dict(
        machine=platform.machine(),
        processor=platform.processor(),
        cpu_model=model,
        cpus=os.cpu_count(),
        isa=torch.backends.cpu.get_cpu_capability(),
        bf16_matmul=sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"}),
        summation=summation_order(),
    )


def _check_inputs(
    model_dir: Path, backend: str, heldout_logprobs: dict[str, Any] | None, data_parallel_size: int
) -> None:
    """Refuse, before any engine starts, a bad backend, checkpoint, held-out logprobs setting or a missing
    offline extraction."""
    from quantkit.evals.degradation import HeldoutLogprobsError
    from quantkit.serve.checkpoint_check import check_servable, check_unquantized

    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == EvalBackend.VLLM:
        check_servable(model_dir)
    else:
        check_unquantized(model_dir, "--backend hf (transformers) evaluates unquantized checkpoints only")
    if heldout_logprobs is not None and (backend != EvalBackend.VLLM or data_parallel_size != 1):
        raise HeldoutLogprobsError(
            "held-out logprobs are recorded by the eval's own vLLM engine: they need backend "
            "vllm and data_parallel_size 1 (lm-eval's replicas are ray workers); use "
            "kl.source: transformers"
        )
    if not is_current(data_dir()):
        raise MissingExtractionError(
            f"offline eval items missing or stale in {data_dir()}: run `make setup` "
            "(or `python -m quantkit.evals.extract`)"
        )


def _kl_tokens(
    tokenizer: Any, heldout_logprobs: dict[str, Any] | None, max_model_len: int
) -> tuple[torch.Tensor | None, int | None]:
    """The held-out windows ((N, L) int64) the engine scores after the tasks and the engine's max_logprobs
    (-1: the whole vocabulary), or (None, None) without `heldout_logprobs`."""
    if heldout_logprobs is None:
        return None, None
    from quantkit.data import heldout_windows
    from quantkit.evals.degradation import HeldoutLogprobsError

    kl_tokens = heldout_windows(tokenizer, heldout_logprobs["num_sequences"], heldout_logprobs["seq_len"])
    if kl_tokens.shape[1] > max_model_len:
        raise HeldoutLogprobsError(
            f"kl seq_len {kl_tokens.shape[1]} exceeds the eval context max_model_len {max_model_len}"
        )
    top_k = heldout_logprobs.get("top_k")
    return kl_tokens, -1 if top_k is None else max(top_k, 20)  # 20: vLLM's default, which lm-eval's requests fit


@dataclass
class _TaskRun:
    """What scoring one task of a suite needs besides the open LM."""

    spec: Suite
    task_manager: Any
    tokenizer: Any
    out_dir: Path
    limit: int | None
    seed: int
    allow_code: bool
    max_model_len: int

    def score(self, lm: Any, task: str) -> dict[str, Any]:
        """Run `task` through lm-eval; write samples/<task or leaf>.jsonl (sorted by doc_id); return its row of
        results.json `tasks`: score (the primary metric, 0-1), metric, filter, n, seconds (wall, all of it),
        sandbox_seconds (of them, running the answers' programs), generated_tokens (the answers' tokens, for
        generation tasks: decode work), truncated_prompts."""
        from quantkit.evals.execution import execution_seconds
        from quantkit.evals.harness import evaluate_tasks

        t0, sandbox0 = time.perf_counter(), execution_seconds()
        out = evaluate_tasks(
            lm,
            [task],
            self.task_manager,
            limit=self.limit,
            seed=self.seed,
            gen_kwargs=self.spec.gen_kwargs,
            allow_unsafe_code=self.allow_code,
            chat_template=self.spec.chat_template,
        )
        seconds, sandbox = time.perf_counter() - t0, execution_seconds() - sandbox0
        n_items = truncated = generated = 0
        pinned = self.spec.pinned_metric(task)
        for name, samples in out["samples"].items():  # a group's leaves, or the task itself
            metric, filt = _primary_metric(out["results"][name], pinned)
            records = sorted(
                (_sample_record(name, s, metric) for s in samples if s.get("filter", filt) == filt),
                key=lambda r: r["doc_id"],
            )
            write_text_atomic(
                self.out_dir / "samples" / f"{name}.jsonl",
                "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records),
            )
            n_items += len(records)
            budget = (out["configs"][name].get("generation_kwargs") or {}).get("max_gen_toks", 256)
            answer_tokens = 1 if _is_choice(records) else budget
            truncated += _truncated(self.tokenizer, records, self.max_model_len, answer_tokens)
            generated += sum(
                len(self.tokenizer(r["answer"])["input_ids"]) for r in records if isinstance(r["answer"], str)
            )
        metric, filt = _primary_metric(out["results"][task], pinned)
        return dict(
            score=out["results"][task][f"{metric},{filt}"],
            metric=metric,
            filter=filt,
            n=n_items,
            seconds=round(seconds, 2),
            sandbox_seconds=round(sandbox, 2),
            generated_tokens=generated,
            truncated_prompts=truncated,
            lm_eval=out["results"][task],
        )


def _run(args: argparse.Namespace) -> int:
    results = evaluate(
        args.model,
        suite=args.suite,
        backend=args.backend,
        out_dir=args.out,
        limit=args.limit,
        allow_code=args.allow_code_execution,
        seed=args.seed,
        max_model_len=args.max_model_len,
    )
    for bench, r in results["benchmarks"].items():
        print(f"{bench:<10} {r['metric']:<12} {r['score']:.4f}  (n={r['n']})")
    print(f"results: {results['out_dir']}/results.json")
    return 0


def add_eval_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`quantkit eval MODEL_DIR [--suite] [--backend] [--out] [--limit] [--allow-code-execution]`."""
    parser = subparsers.add_parser("eval", help="score a checkpoint on an evaluation suite with lm-eval (vLLM or hf)")
    parser.add_argument("model", help="checkpoint directory")
    parser.add_argument("--suite", default="mini", help=f"suite name ({', '.join(available_suites())}) or YAML path")
    parser.add_argument("--backend", default="vllm", choices=BACKENDS)
    parser.add_argument("--out", default=None, help="output directory (default: runs/eval/<model>-<suite>)")
    parser.add_argument("--limit", type=int, default=None, help="items per task (default: the suite's)")
    parser.add_argument(
        "--allow-code-execution",
        action="store_true",
        help="run code benchmarks: executes model-written programs in subprocesses",
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help=f"context (default: the checkpoint's max_position_embeddings, at most {MAX_CONTEXT})",
    )
    parser.set_defaults(func=_run)
    return parser
