"""The table2 suite's protocol (configs/suites/table2.yaml `protocol`, docs/protocol.md) is what
lm-eval actually runs, checked offline.

Every table2 task is built through lm-eval's TaskManager exactly as `quantkit eval --suite table2` builds
it (our group overrides on lm-eval's own tasks). The hub datasets are replaced by fixture documents written
here: `datasets.load_dataset` inside lm-eval's task module returns them, so every split a task draws
exemplars or items from exists, with the fields lm-eval's prompt templates and process_docs read. Each
fixture question carries a unique marker `FIXTURE-<i>`.

1. Settings: each leaf task's effective num_fewshot, generation_kwargs, metric and filter equal the table
   (a changed lm-eval default or a lost override fails here), and every generative task samples once.
2. Prompts and scoring: the first leaf of every column scores one fixture document, all twelve in ONE
   `simple_evaluate` call (lm-eval's hf backend), pinned settings untouched. The per-sample log must hold the
   pinned generation kwargs and a prompt with exactly num_fewshot exemplars plus the scored item (counted
   by a marker that occurs once per item), and a score for the pinned metric. The checkpoint is conftest's
   tiny random model with its final norm zeroed (`build_eos_checkpoint`): every logit is 0, greedy decoding
   picks id 0 = EOS, so each request decodes one token instead of its pinned budget (a random model never
   stops early and generated ~7.7k tokens here through vLLM, ~8 min under load). Accuracy is not asserted.

Cost (2 CPU cores, under load from other jobs, load average 6-12): ~190 s in all: part 1 ~120 s (lm-eval's
task index ~45 s, building the ~900 leaf tasks ~70 s, 798 of them MMMLU's, on fixture datasets cached per
(path, name)); part 2 30-90 s (building the checkpoint ~15 s, twelve one-item evaluations ~30 s). Before
(one vLLM `simple_evaluate` per column on a random model that never stops early): 504 s.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lm_eval.api.task
import pytest
import torch
from datasets import Dataset, DatasetDict
from lm_eval.tasks import TaskManager

from quantkit.evals.execution import ALLOW_ENV
from quantkit.evals.extract import extract
from quantkit.evals.harness import evaluate_tasks, open_lm
from quantkit.evals.suite import TASK_CONFIGS, load_suite

SUITE = load_suite("table2")
ROOT = Path(__file__).resolve().parents[1]
LM_EVAL_TASKS = Path(lm_eval.api.task.__file__).resolve().parent.parent / "tasks"
MMLU_PRO_CATEGORIES = [
    "biology",
    "business",
    "chemistry",
    "computer science",
    "economics",
    "engineering",
    "health",
    "history",
    "law",
    "math",
    "other",
    "philosophy",
    "physics",
    "psychology",
]
MMMLU_SUBJECTS = json.loads((LM_EVAL_TASKS / "openai-mmmlu" / "subjects.json").read_text())
N = 10  # fixture items per split (per category/subject where lm-eval filters by one): > 8 exemplars + the item


def _row(path: str, name: str | None, i: int, split: str) -> list[dict[str, Any]]:
    """Fixture item(s) number i of a hub dataset, in its schema; the question holds `FIXTURE-<i>`."""
    q = f"FIXTURE-{i} What is {i} + {i}?"
    if path == "fxmarty/mmlu-redux-2.0-ok":
        return [dict(question=q, choices=[str(2 * i), "1", "2", "3"], answer=0)]
    if path == "TIGER-Lab/MMLU-Pro":
        return [
            dict(
                question_id=i,
                question=q,
                options=[str(2 * i), "1", "2", "3"],
                answer="A",
                answer_index=0,
                cot_content=f"A: Let's think step by step. {i} + {i} = {2 * i}. The answer is (A).",
                category=c,
                src="fixture",
            )
            for c in MMLU_PRO_CATEGORIES
        ]
    if path == "Idavidrein/gpqa":
        return [
            {
                "Question": q,
                "Correct Answer": str(2 * i),
                "Incorrect Answer 1": "1",
                "Incorrect Answer 2": "2",
                "Incorrect Answer 3": "3",
            }
        ]
    if path == "openai/gsm8k":
        return [dict(question=q, answer=f"{i} + {i} = {2 * i}\n#### {2 * i}")]
    if path == "EleutherAI/hendrycks_math":
        return [dict(problem=q, solution=f"${i}+{i}=\\boxed{{{2 * i}}}$", level="Level 1", type=name)]
    if path == "cruxeval-org/cruxeval":
        return [dict(code="def f(x):\n    return x + x", input=str(i), output=str(2 * i), id=f"sample_{i}")]
    if path == "openai/MMMLU":
        return [dict(Question=q, A=str(2 * i), B="1", C="2", D="3", Answer="A", Subject=s) for s in MMMLU_SUBJECTS]
    if path == "juletxara/mgsm":  # exemplars (train) carry the worked answer, test items only the number
        answer = f"Step-by-Step Answer: {i} + {i} = {2 * i}. The answer is {2 * i}." if split == "train" else None
        return [dict(question=q, answer=answer, answer_number=2 * i, equation_solution=f"{i}+{i}={2 * i}")]
    if path == "nuprl/MultiPL-E":
        return [
            dict(
                name=f"fixture_{i}",
                language="py",
                prompt=f'def double_{i}(x):\n    """{q}"""\n',
                tests=f"\n\nassert double_{i}({i}) == {2 * i}\n",
                doctests="",
                original="",
                prompt_terminology="",
                stop_tokens=["\ndef"],
            )
        ]
    if path == "google-research-datasets/mbpp":
        return [
            dict(
                task_id=100 + i,
                text=q,
                code="def add(a, b):\n    return a + b",
                test_list=[f"assert add({i}, {i}) == {2 * i}"],
                test_setup_code="",
                challenge_test_list=[],
            )
        ]
    if path == "m-a-p/SuperGPQA":
        return [dict(question=q, options=[str(2 * i), "1", "2", "3"], answer_letter="A")]
    raise AssertionError(f"no fixture schema for hub dataset {path!r}: a table2 task reads a new dataset")


@functools.cache
def fixture_load_dataset(path: str, name: str | None = None, **_: Any) -> DatasetDict:
    """Stands in for datasets.load_dataset in lm-eval's task module: N fixture items per split. Cached per
    (path, name): lm-eval never assigns into a loaded DatasetDict, and MMMLU's 798 leaves read 14 of them."""
    return DatasetDict(
        {
            split: Dataset.from_list([r for i in range(N) for r in _row(path, name, i, split)])
            for split in ("train", "validation", "test", "dev")
        }
    )


@pytest.fixture(scope="module")
def manager() -> Iterator[TaskManager]:
    """lm-eval's registry plus our task directories, with hub datasets replaced by the fixtures."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm_eval.api.task.datasets, "load_dataset", fixture_load_dataset)
        extract()  # qk_mbpp_full's exemplars and qk_humaneval's items come from the offline extraction
        yield TaskManager(include_path=[str(p) for p in TASK_CONFIGS[SUITE.task_configs]], include_defaults=True)


@functools.cache
def _built(manager: TaskManager, bench: str) -> list[tuple[str, Any]]:
    """(leaf name, Task) of a column, built once per module (MMMLU alone has 798 leaves)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm_eval.api.task.datasets, "load_dataset", fixture_load_dataset)
        return [leaf for task in SUITE.benchmarks[bench] for leaf in manager.load([task])["tasks"].items()]


def _metric_names(task: Any) -> set[str]:
    """The result names a task's metrics report under: per-item metrics by name; a corpus-level metric taking
    `k` (lm-eval's cruxeval `pass_at_k`) reports `pass@<k>` for each k."""
    names = set(task._metric_fn_list)
    for m in task.config.metric_list or []:
        names |= {f"pass@{k}" for k in m.get("k", [])}
    return names


def _expected_gen_kwargs(bench: str, leaf: str) -> dict[str, Any] | None:
    pinned = SUITE.protocol[bench]["generation_kwargs"]
    if pinned is None:
        return None
    until = pinned["until"]
    return {**pinned, "until": until[leaf] if isinstance(until, dict) else until}


def test_table_covers_the_paper_columns_and_avg():
    assert SUITE.avg == [
        "MMLU-R",
        "MMLU-P",
        "S-GPQA",
        "GPQA-D",
        "GSM8k",
        "Math",
        "Crux",
        "MultiPL_E",
        "MBPP",
        "MMMLU",
        "MGSM",
    ]
    assert set(SUITE.benchmarks) - set(SUITE.avg) == {"HumanEval"}
    assert load_suite("full") == SUITE  # `full` is an alias


@pytest.mark.parametrize("bench", list(SUITE.benchmarks))
def test_effective_settings_match_the_table(bench, manager):
    row = SUITE.protocol[bench]
    leaves = _built(manager, bench)
    assert leaves
    for name, task in leaves:
        cfg = task.config
        assert cfg.num_fewshot == row["num_fewshot"], (name, cfg.num_fewshot)
        assert (cfg.output_type == "generate_until") == (row["generation_kwargs"] is not None), name
        assert cfg.generation_kwargs == _expected_gen_kwargs(bench, name) or row["generation_kwargs"] is None, (
            name,
            cfg.generation_kwargs,
        )
        assert cfg.repeats == 1, name
        assert row["metric"] in _metric_names(task), (name, sorted(_metric_names(task)))
        filters = [f.name for f in task._filters]
        assert row["filter"] in filters, (name, filters)
        if row["num_fewshot"]:
            assert task.sampler is not None and len(task.sampler.sample(row["num_fewshot"])) == row["num_fewshot"]


# Counted in the logged prompt: once per exemplar and once for the scored item.
MARKERS = {"GSM8k": "Q: ", "Math": "Problem:", "Crux": "[PYTHON]", "MBPP": "[BEGIN]", "HumanEval": "def "}


def build_eos_checkpoint(out_dir: Path) -> Path:
    """conftest's tiny random checkpoint (4096 positions: MMLU-P's 2048-token budget plus a 5-shot prompt)
    with its final norm's weight zeroed: the last hidden state is exactly 0, so every logit is 0 and greedy
    decoding takes the first of the tied maxima, id 0, `<|endoftext|>`, the tokenizer's EOS. Every request
    decodes one token and stops, whatever its pinned budget; the prompt still runs through every layer."""
    from quantkit.models import QuantkitForCausalLM
    from quantkit.models.tiny import build_tiny_checkpoint

    model_dir = build_tiny_checkpoint(out_dir, seed=0, max_position_embeddings=4096)
    model = QuantkitForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def fixture_run(manager, tmp_path_factory) -> tuple[dict[str, tuple[str, Any]], dict[str, Any]]:
    """({column: (leaf name, Task)}, lm-eval's output): the first leaf of every column scored on one fixture
    item in ONE `simple_evaluate` call, pinned settings untouched. lm-eval's hf backend: with one decoded token
    per request its load (<1 s) beats a vLLM engine start (~80 s on 2 loaded cores); the prompts, requests and
    scoring are lm-eval's whichever backend answers (vLLM under lm-eval: tests/test_evals_suite.py)."""
    leaves = {bench: _built(manager, bench)[0] for bench in SUITE.benchmarks}
    model_dir = build_eos_checkpoint(tmp_path_factory.mktemp("eos4k") / "model")
    with pytest.MonkeyPatch.context() as mp, open_lm(model_dir, "hf", max_model_len=4096, dtype="float32") as lm:
        mp.setenv(ALLOW_ENV, "1")
        mp.setattr(lm_eval.api.task.datasets, "load_dataset", fixture_load_dataset)
        out = evaluate_tasks(lm, [task for _, task in leaves.values()], manager, limit=1, allow_unsafe_code=True)
    return leaves, out


@pytest.mark.slow  # the shared fixture_run: 30-90 s under load (part 1 is the cheap check of the same table)
@pytest.mark.parametrize("bench", list(SUITE.benchmarks))
def test_fixture_item_scores_with_the_fewshot_context_in_the_prompt(bench, fixture_run):
    leaves, out = fixture_run
    row = SUITE.protocol[bench]
    name, task = leaves[bench]
    samples = [s for s in out["samples"][name] if s["filter"] == row["filter"]]
    assert len(samples) == 1
    sample = samples[0]
    prompt, gen_kwargs = sample["arguments"][0][0], sample["arguments"][0][1]
    if row["generation_kwargs"] is not None:
        assert gen_kwargs == _expected_gen_kwargs(bench, name)
        assert sample["resps"] == [[""]]  # the EOS checkpoint stopped at once: the run cost no decode budget
    marker = MARKERS.get(bench, "FIXTURE-")
    if bench == "HumanEval":  # 0-shot completion: the prompt is the item's own
        assert prompt == task.doc_to_text(sample["doc"])
    else:
        assert prompt.count(marker) == row["num_fewshot"] + 1, prompt
    assert sample["filtered_resps"] and f"{row['metric']},{row['filter']}" in out["results"][name]


def test_crux_programs_run_in_quantkit_sandbox(manager, monkeypatch):
    """Crux's metric is quantkit's (evals/tasks/table2/utils.py), not lm-eval's in-process `exec`: refused without
    the opt-in, and with it each program runs in the sandbox (a passing and a failing assertion: pass@1 0.5)."""
    from quantkit.evals.execution import CodeExecutionRefused

    ((_, task),) = _built(manager, "Crux")
    metric = task.config.metric_list[0]["metric"]
    assert Path(metric.__code__.co_filename) == ROOT / "evals" / "tasks" / "table2" / "utils.py"
    programs = [
        ["def f(x):\n    return x + x\nassert f(2) == 4\n"],
        ["def f(x):\n    return x + x\nassert f(2) == 5\n"],
    ]
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(CodeExecutionRefused):
        metric(["", ""], programs, k=[1])
    monkeypatch.setenv(ALLOW_ENV, "1")
    assert metric(["", ""], programs, k=[1]) == {"pass@1": 0.5}


def test_report_avg_is_over_the_paper_columns_only():
    """A table2 results file with HumanEval beside the 11 paper columns: Avg and ΔAvg leave HumanEval out
    (exact arithmetic on points: 11 columns at 40 and HumanEval at 95 give Avg 40, ΔAvg over the 11 only)."""
    from quantkit.report.render import to_markdown
    from quantkit.report.results import load_results
    from quantkit.report.table import build_table

    base = {b: 40.0 for b in SUITE.benchmarks} | {"HumanEval": 95.0}
    quant = {b: 38.0 for b in SUITE.benchmarks} | {"HumanEval": 10.0}
    rows = [
        dict(variant="ga", recipe=r, precision=p, scores=s)
        for r, p, s in (("bf16", "BF16", base), ("w4a4_nvfp4", "W4A4", quant))
    ]
    table = build_table(load_results(dict(schema_version=1, suite="table2", rows=rows)))
    assert [r.avg for r in table.rows] == [40.0, 38.0]
    assert table.rows[1].degradation.delta_avg == -2.0 and table.rows[1].degradation.delta["humaneval"] == -85.0
    assert [b.label for b in table.not_in_avg] == ["HumanEval"]
    assert "except HumanEval" in to_markdown(table)
    mini = build_table(load_results(dict(schema_version=1, suite="mini", rows=rows)))  # no `avg`: every column
    assert mini.rows[0].avg == (11 * 40.0 + 95.0) / 12 and mini.not_in_avg == ()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(avg=["MMLU-R", "Nope"]), "avg must list"),
        (dict(protocol={"MMLU-R": {"num_fewshot": 5}}), "protocol needs one row per benchmark"),
    ],
)
def test_suite_avg_and_protocol_are_validated(change, message, tmp_path):
    import yaml

    from quantkit.configs import SUITES_DIR

    raw = yaml.safe_load((SUITES_DIR / "table2.yaml").read_text()) | change
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=message):
        load_suite(tmp_path / "bad.yaml")
