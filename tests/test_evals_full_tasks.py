"""The full-size offline tasks (issue 49): ARC-Challenge, HellaSwag and WinoGrande (cloze), GSM8K's 1319 items
(completion and chat forms), MBPP's 500 (completion and instruct forms) and HumanEval in EvalPlus's protocol,
run through lm-eval on items checked by hand against the raw OLMES / human-eval records: the prompt or requests
lm-eval builds, the gold answer accepted, a wrong one rejected, the code executed (a wrong program scoring 0 and a
right one 1 is only possible when it ran). The suites' item counts are the published split sizes."""

import lm_eval
import pytest
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

from quantkit.evals.execution import ALLOW_ENV
from quantkit.evals.extract import extract, load_rows
from quantkit.evals.scoring import humaneval_script_program, script_definitions
from quantkit.evals.suite import TASK_CONFIGS, load_suite


class ScriptedLM(LM):
    """A stand-in model: generates `answer(doc)`; in multiple choice gives choice `pick(doc)` the highest
    log-likelihood. Chats render as "<|role|>content<|end|>" turns; a final assistant turn (a task's gen_prefix)
    is left open, as a tokenizer's `continue_final_message` does."""

    def __init__(self, answer=None, pick=None) -> None:
        super().__init__()
        self.answer, self.pick = answer, pick
        self.prompts: list[str] = []

    def loglikelihood(self, requests):
        return [(0.0 if request.idx == self.pick(request.doc) else -5.0, False) for request in requests]

    def generate_until(self, requests):
        self.prompts += [request.args[0] for request in requests]
        return [self.answer(request.doc) for request in requests]

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError

    @property
    def tokenizer_name(self) -> str:
        return "scripted"

    def chat_template(self, chat_template=False) -> str:
        return "scripted"

    def apply_chat_template(self, chat_history, add_generation_prompt=True) -> str:
        text = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in chat_history)
        return text + "<|assistant|>" if add_generation_prompt else text.removesuffix("<|end|>")


@pytest.fixture(scope="module")
def task_manager():
    extract()  # idempotent: a no-op after `make setup`
    return TaskManager(include_path=[str(p) for p in TASK_CONFIGS["mini"]], include_defaults=False)


def _run(task_manager, task: str, docs: list[int], lm: ScriptedLM, chat: bool = False) -> list[dict]:
    """lm-eval's per-item records of `task` on items `docs` (in that order), code execution allowed."""
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=[task],
        task_manager=task_manager,
        samples={task: docs},
        apply_chat_template=chat,
        confirm_run_unsafe_code=True,
        bootstrap_iters=0,
    )
    by_doc = {s["doc_id"]: s for s in out["samples"][task]}
    return [by_doc[d] for d in docs]


# Read from the raw request files (doc, request contexts and continuations) and checked by reading each item.
CLOZE = {
    "qk_arc_challenge": {
        0: (
            "Question: An astronomer observes that a planet rotates faster after a meteorite impact. Which is the most "
            "likely effect of this increase in rotation?\nAnswer:",
            4,
            2,
            " Planetary days will become shorter.",
        ),
        121: (
            "Question: A toy truck rolls over a smooth surface. If the surface is covered with sand, the truck will "
            "most likely roll\nAnswer:",
            3,
            0,
            " slower",
        ),
    },
    "qk_hellaswag": {
        0: ("Roof shingle removal: A man is sitting on a roof. He", 4, 3, " starts pulling up roofing on a roof."),
        # ActivityNet item 8 and WikiHow item 3260 share the native id (`ind`) 180: items are keyed by doc_id
        8: (
            "Sharpening knives: A man is holding a pocket knife while sitting on some rocks in the wilderness. Then he",
            4,
            1,
            " takes a small stone from the flowing river and smashes it on another stone.",
        ),
        3260: (
            "Work World: How to become a sports announcer. Research the field. Before you pursue any formal "
            "education, do enough research to know what you can expect from this career field. Check into your "
            "expected duties, work environment, expected pay, and job outlook.",
            4,
            1,
            " Most sports announcers are either play-by-play announcers, talk show hosts, or sports anchors. Your "
            "duties may require you to announce plays, provide commentary, and interview guests.",
        ),
    },
}


@pytest.mark.parametrize("task", sorted(CLOZE))
def test_cloze_items_have_their_query_choices_and_gold(task, task_manager):
    docs = list(CLOZE[task])
    right = _run(task_manager, task, docs, ScriptedLM(pick=lambda doc: doc["answer"]))
    wrong = _run(task_manager, task, docs, ScriptedLM(pick=lambda doc: (doc["answer"] + 1) % len(doc["choices"])))
    for record, bad, doc_id in zip(right, wrong, docs):
        query, n_choices, gold, gold_text = CLOZE[task][doc_id]
        contexts, continuations = zip(*record["arguments"])  # one (context, continuation) request per choice
        assert set(contexts) == {query} and len(continuations) == n_choices and continuations[gold] == gold_text
        assert (record["target"], record["acc"], bad["acc"]) == (gold, 1.0, 0.0)


def test_winogrande_scores_the_rest_of_the_sentence_after_each_option(task_manager):
    """Partial scoring: the two requests share the continuation after the blank; their contexts end with each option.
    Item 0 ("... so _ always got the easier cases.") is Maria's, item 1 ("... harder cases.") Sarah's."""
    stem = "Sarah was a much better surgeon than Maria so "
    right = _run(task_manager, "qk_winogrande", [0, 1], ScriptedLM(pick=lambda doc: doc["answer"]))
    wrong = _run(task_manager, "qk_winogrande", [0, 1], ScriptedLM(pick=lambda doc: 1 - doc["answer"]))
    for record, bad, (ending, gold) in zip(right, wrong, (("easier", 1), ("harder", 0))):
        expected = [(stem + name, f" always got the {ending} cases.") for name in ("Sarah", "Maria")]
        assert [tuple(args) for args in record["arguments"]] == expected
        assert (record["doc"]["answer"], record["acc"], bad["acc"]) == (gold, 1.0, 0.0)


@pytest.mark.parametrize("task, chat", [("qk_gsm8k_full", False), ("qk_gsm8k_full_chat", True)])
def test_gsm8k_full_forms_check_the_final_number(task, chat, task_manager):
    """Items 0 (Janet's ducks: 16 - 3 - 4 = 9 eggs at $2 = 18) and 1318 (7 x 8 = 56 slices for 4 people = 14)."""
    answers = {
        "18": ("She sells 16 - 3 - 4 = 9 eggs for 9 * 2 = $18 a day.\nThe final answer is 18", "17"),
        "14": ("There are 7 * 8 = 56 slices for 4 people, 56 / 4 = 14 each.\nThe final answer is 14", "15"),
    }
    lm = ScriptedLM(answer=lambda doc: answers[doc["answer"]][0])
    right = _run(task_manager, task, [0, 1318], lm, chat=chat)
    wrong = _run(
        task_manager,
        task,
        [0, 1318],
        ScriptedLM(answer=lambda doc: f"The final answer is {answers[doc['answer']][1]}"),
        chat=chat,
    )
    assert [r["exact_match"] for r in right] == [1, 1] and [r["exact_match"] for r in wrong] == [0, 0]
    if chat:
        assert lm.prompts[0].startswith(
            "<|user|>Given the following problem, reason and give a final answer to the "
            "problem.\nProblem: Janet’s ducks lay 16 eggs per day."
        )
        assert lm.prompts[0].endswith("where [answer] is the response to the problem.\n<|end|><|assistant|>")
    else:
        assert lm.prompts[0].startswith("Question: Janet’s ducks") and lm.prompts[0].endswith("market?\nAnswer:")


# Hand-written solutions (not the dataset's) to MBPP tasks 11 and 367 (its tests build trees of a `Node` class the
# solution must define, in its test_setup_code), and wrong ones that still run.
MBPP = {
    11: (
        "def remove_Occ(s, ch):\n    i = s.find(ch)\n    if i >= 0:\n        s = s[:i] + s[i + 1:]\n"
        "    j = s.rfind(ch)\n    if j >= 0:\n        s = s[:j] + s[j + 1:]\n    return s",
        "def remove_Occ(s, ch):\n    return s[1:-1]",
    ),
    367: (
        "class Node:\n    def __init__(self, data):\n        self.data, self.left, self.right = data, None, None\n\n"
        "def depth(node):\n    return 0 if node is None else 1 + max(depth(node.left), depth(node.right))\n\n"
        "def is_tree_balanced(root):\n    if root is None:\n        return True\n"
        "    return abs(depth(root.left) - depth(root.right)) <= 1 and is_tree_balanced(root.left) "
        "and is_tree_balanced(root.right)",
        "class Node:\n    def __init__(self, data):\n        self.data, self.left, self.right = data, None, None\n\n"
        "def is_tree_balanced(root):\n    return True",
    ),
}


@pytest.mark.parametrize("task, chat", [("qk_mbpp_500", False), ("qk_mbpp_500_instruct", True)])
def test_mbpp_500_executes_the_solution_against_the_asserts(task, chat, task_manager, monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "1")
    rows = load_rows("mbpp_full")
    docs = [next(i for i, r in enumerate(rows) if r["task_id"] == t) for t in MBPP]
    lm = ScriptedLM(answer=lambda doc: MBPP[doc["task_id"]][0])
    right = _run(task_manager, task, docs, lm, chat=chat)
    wrong = _run(task_manager, task, docs, ScriptedLM(answer=lambda doc: MBPP[doc["task_id"]][1]), chat=chat)
    assert [r["pass@1"] for r in right] == [1.0, 1.0] and [r["pass@1"] for r in wrong] == [0.0, 0.0]
    tests = (
        '\nassert remove_Occ("hello","l") == "heo"\nassert remove_Occ("abcda","a") == "bcd"'
        '\nassert remove_Occ("PHP","P") == "H"'
    )
    if chat:  # lm-eval's mbpp_instruct wording, zero-shot
        assert lm.prompts[0] == (
            "<|user|>You are an expert Python programmer, and here is your task:\nWrite a python "
            "function to remove first and last occurrence of a given character from the string.\n"
            f"Your code should pass these tests:{tests}<|end|><|assistant|>\n```python\n"
        )
    else:  # lm-eval's mbpp prompt after its 3 exemplars (MBPP tasks 2-4)
        assert lm.prompts[0].count("[DONE]") == 3 and "[BEGIN]\ndef similar_elements(" in lm.prompts[0]
        assert lm.prompts[0].endswith(f"from the string. Your code should pass these tests:\n{tests}\n[BEGIN]\n")


HAS_CLOSE = """from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])


# Example usage:
assert has_close_elements([1.0, 2.0], 0.5) is True  # a wrong example, dropped as EvalPlus's sanitizer drops it
result = has_close_elements([1.0, 2.8, 3.0], 0.3)
"""


def test_script_definitions_keeps_what_evalplus_keeps():
    assert script_definitions(HAS_CLOSE) == (
        "from typing import List\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
        "    return any((abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:]))\n"
        "result = has_close_elements([1.0, 2.8, 3.0], 0.3)"
    )
    assert script_definitions("    return x\n") == "    return x\n"  # does not parse: unchanged, and fails


def test_humaneval_evalplus_prompt_is_evalplus_and_the_whole_script_runs(task_manager, monkeypatch):
    """EvalPlus's codegen.py prompt (instruction_prefix, the prompt stripped in a bare fence; response_prefix and a
    Python fence opening the answer); the model's whole script (with its own example lines) runs after the prompt
    against HumanEval's tests. HumanEval/38's tests call the prompt's `encode_cyclic`, which a script need not
    repeat."""
    monkeypatch.setenv(ALLOW_ENV, "1")
    decode = "def decode_cyclic(s: str):\n    return encode_cyclic(encode_cyclic(s))\n"
    scripts = {
        "HumanEval/0": (HAS_CLOSE, HAS_CLOSE.replace("< threshold", "> threshold")),
        "HumanEval/38": (decode, decode.replace("(encode_cyclic(s))", "(s)")),
    }
    lm = ScriptedLM(answer=lambda doc: scripts[doc["task_id"]][0] + "```")
    right = _run(task_manager, "qk_humaneval_evalplus", [0, 38], lm, chat=True)
    wrong = _run(
        task_manager,
        "qk_humaneval_evalplus",
        [0, 38],
        ScriptedLM(answer=lambda doc: scripts[doc["task_id"]][1]),
        chat=True,
    )
    assert [r["pass@1"] for r in right] == [1.0, 1.0] and [r["pass@1"] for r in wrong] == [0.0, 0.0]
    prompt = load_rows("humaneval")[0]["prompt"]
    assert lm.prompts[0] == (
        "<|user|>Please provide a self-contained Python script that solves the following problem in a markdown code "
        f"block:\n```\n{prompt.strip()}\n```\n<|end|><|assistant|>Below is a Python script with a self-contained "
        "function that solves the problem and passes corresponding tests:\n```python\n"
    )
    program = humaneval_script_program(load_rows("humaneval")[0], HAS_CLOSE + "```\nThis works because ...")
    assert program.startswith(prompt) and "This works" not in program
    assert program.endswith("check(has_close_elements)\n")


@pytest.mark.parametrize(
    "suite, tables",
    [
        ("code", {"HumanEval": "humaneval", "MBPP": "mbpp_full"}),
        ("code-evalplus", {"HumanEval": "humaneval"}),
        (
            "commonsense",
            {
                "ARC-E": "arc_easy",
                "ARC-C": "arc_challenge",
                "HellaSwag": "hellaswag",
                "Winogrande": "winogrande",
                "PIQA": "piqa",
            },
        ),
        ("commonsense-small", {"ARC-E": "arc_easy", "HellaSwag": "hellaswag", "PIQA": "piqa"}),
        ("gsm8k", {"GSM8k": "gsm8k_full"}),
    ],
)
def test_suites_run_every_item_of_the_published_splits(suite, tables, task_manager):
    """Published sizes: HumanEval 164, MBPP test 500 (the code suite's Avg column pools the two: 664), ARC-Easy test
    2376, ARC-Challenge test 1172, HellaSwag validation 10042, WinoGrande (XL) validation 1267, PIQA validation 1838,
    GSM8K test 1319."""
    sizes = {
        "humaneval": 164,
        "mbpp_full": 500,
        "arc_easy": 2376,
        "arc_challenge": 1172,
        "hellaswag": 10042,
        "winogrande": 1267,
        "piqa": 1838,
        "gsm8k_full": 1319,
    }
    spec = load_suite(suite)
    pooled = {"HumanEval+MBPP": ["HumanEval", "MBPP"]} if suite == "code" else {}  # a column of others' items
    assert spec.limit is None and list(spec.benchmarks) == [*tables, *pooled]
    assert {b: len(load_rows(t)) for b, t in tables.items()} == {b: sizes[t] for b, t in tables.items()}
    for column, parts in pooled.items():  # the code suite's Avg: 164 + 500 programs, each task run once
        assert spec.benchmarks[column] == [t for b in parts for t in spec.benchmarks[b]] and spec.avg == [column]
    assert len(spec.tasks(allow_code=True)) == len(tables)
    assert spec.chat_template == (not suite.startswith("commonsense"))
    assert set(spec.code) == (set(tables) | set(pooled) if suite.startswith("code") else set())
    assert all(t in task_manager.all_tasks for t in spec.tasks(allow_code=True))
