"""Scorer check of the offline mini-suite through lm-eval itself: a model that answers every item from
its reference scores 1.0 on every task, one that always answers wrongly scores 0.0.

The "model" is an lm-eval LM subclass that reads each request's doc (`reference`: the gold choice's
letter or text, WinoGrande's gold context, or the text a perfect model would generate); everything else -
prompts, filters, our process_results, code execution, aggregation - is lm-eval's machinery on the real
extracted items.
"""

import os

import lm_eval
import pytest
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

from quantkit.evals.execution import ALLOW_ENV
from quantkit.evals.extract import extract
from quantkit.evals.suite import TASK_CONFIGS, load_suite

WRONG = "The answer is \\boxed{-987654321}."


class ReferenceLM(LM):
    """Answers from `doc["reference"]` (gold=True) or with a wrong answer (gold=False)."""

    def __init__(self, gold: bool) -> None:
        super().__init__()
        self.gold = gold

    def loglikelihood(self, requests):
        out = []
        for request in requests:
            context, continuation = request.args  # WinoGrande's choices are contexts, the rest is shared
            right = (request.doc["reference"] in (context, continuation.strip())) == self.gold
            out.append((0.0 if right else -5.0, right))
        return out

    def generate_until(self, requests):
        return [request.doc["reference"] if self.gold else WRONG for request in requests]

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError("no rolling log-likelihood task in the suite")


def _tasks(suite: str):
    extract()  # idempotent: a no-op after `make setup`
    tasks = load_suite(suite).tasks(allow_code=True)
    return tasks, TaskManager(include_path=[str(p) for p in TASK_CONFIGS["mini"]], include_defaults=False)


@pytest.fixture(scope="module")
def mini_tasks():
    return _tasks("mini")


def _scores(suite: str, gold: bool, monkeypatch) -> tuple[dict[str, float], int]:
    """{task: its primary metric} of `suite` answered by ReferenceLM(gold), and the items scored."""
    tasks, task_manager = _tasks(suite)
    monkeypatch.setenv(ALLOW_ENV, "1")
    out = lm_eval.simple_evaluate(
        model=ReferenceLM(gold),
        tasks=tasks,
        task_manager=task_manager,
        confirm_run_unsafe_code=True,
        bootstrap_iters=0,
        log_samples=False,
    )
    scores = {}
    for task in tasks:
        result = out["results"][task]
        (key,) = [k for k in result if "," in k and "_stderr" not in k]
        scores[task] = result[key]
    return scores, sum(out["n-samples"][t]["effective"] for t in tasks)


@pytest.mark.parametrize(
    "suite, items", [("mini", 3435), ("commonsense", 2376 + 1172 + 10042 + 1267 + 1838), ("gsm8k", 1319)]
)
@pytest.mark.parametrize("gold, expected", [(True, 1.0), (False, 0.0)])
def test_reference_answers_score_one_and_wrong_answers_zero(suite, items, gold, expected, monkeypatch):
    scores, n = _scores(suite, gold, monkeypatch)
    assert scores == dict.fromkeys(scores, expected) and n == items


@pytest.mark.slow
def test_every_code_suite_reference_passes(monkeypatch):
    """The code suite's 664 reference programs (HumanEval's canonical solutions, MBPP's test-split code) pass their
    tests through the instruct tasks, each executed (~2.5 min on 2 cores); wrong answers are covered above (mini's
    HumanEval) and in test_evals_full_tasks.py."""
    assert _scores("code", True, monkeypatch) == ({"qk_humaneval_instruct": 1.0, "qk_mbpp_500_instruct": 1.0}, 664)


def test_code_tasks_refuse_without_opt_in(mini_tasks, monkeypatch):
    _, task_manager = mini_tasks
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(ValueError, match="unsafe"):  # lm-eval's own gate on `unsafe_code: true`
        lm_eval.simple_evaluate(model=ReferenceLM(True), tasks=["qk_mbpp"], task_manager=task_manager)
    assert os.environ.get(ALLOW_ENV) is None
