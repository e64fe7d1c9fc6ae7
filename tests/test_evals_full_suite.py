"""The full (hub) suite, as far as it can be checked offline: every lm-eval task name exists in the
installed registry, and our own task configs (SuperGPQA, MultiPL-E, MBPP) load, render prompts on
fixture docs and score through lm-eval: reference answers 1.0, wrong answers 0.0 (code executed)."""

import lm_eval
import pytest
from datasets import Dataset
from lm_eval.api.task import ConfigurableTask
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml
from test_evals_scorers import ReferenceLM

from quantkit.evals.execution import ALLOW_ENV, missing_tools
from quantkit.evals.extract import extract
from quantkit.evals.suite import TASK_CONFIGS, TASKS_DIR, load_suite

JAVA_IMPORTS = "".join(
    f"import {p};\n"
    for p in (
        "java.util.*",
        "java.lang.reflect.*",
        "org.javatuples.*",
        "java.security.*",
        "java.math.*",
        "java.io.*",
        "java.util.stream.*",
    )
)
CS_USINGS = "".join(
    f"using {n};\n"
    for n in (
        "System",
        "System.Numerics",
        "System.Diagnostics",
        "System.Collections.Generic",
        "System.Linq",
        "System.Text",
        "System.Security.Cryptography",
    )
)
FIXTURES = {
    "qk_supergpqa": [
        dict(
            question="Which gas makes up most of Earth's atmosphere?",
            options=["Oxygen", "Argon", "Nitrogen", "CO2", "Neon"],
            answer_letter="C",
            reference="Air is about 78% nitrogen. The answer is (C).",
        )
    ],
    "qk_mbpp_full": [
        dict(
            task_id=11,
            text="Write a python function to add two numbers.",
            code="def add(a, b):\n    return a + b",
            test_list=["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"],
            test_setup_code="",
            challenge_test_list=[],
            reference="def add(a, b):\n    return a + b\n",
        )
    ],
    "qk_multiple_cpp": [
        dict(
            language="cpp",
            prompt="#include<cassert>\n// Sum of a and b.\nlong add(long a, long b) {\n",
            tests="}\nint main() {\n    auto candidate = add;\n    assert(candidate((1), (2)) == (3));\n}\n",
            reference="    return a + b;",
        )
    ],
    "qk_multiple_js": [
        dict(
            language="js",
            prompt="//Sum of a and b.\nfunction add(a, b){\n",
            tests="\nconst assert = require('node:assert');\nassert.deepEqual(add(1, 2), 3);\n",
            reference="  return a + b;\n}",
        )
    ],
    "qk_multiple_sh": [
        dict(
            language="sh",
            prompt="#!/bin/bash\n# Sum of $1 and $2.\nadd() {\n",
            tests="}\n\nset -e\n[[ $(add 1 2) = 3 ]]\n",
            reference="    echo $(( $1 + $2 ))",
        )
    ],
    "qk_multiple_py": [
        dict(
            language="py",
            prompt='def add(a, b):\n    """Sum of a and b."""\n',
            tests="\n\ndef check(candidate):\n    assert candidate(1, 2) == 3\n\ncheck(add)\n",
            reference="    return a + b\n",
        )
    ],
    "qk_multiple_rs": [
        dict(
            language="rs",
            prompt="/// Sum of a and b.\nfn add(a: isize, b: isize) -> isize {\n",
            tests="}\n\nfn main() {\n    assert_eq!(add(1, 2), 3);\n}\n",
            reference="    a + b",
        )
    ],
    # MultiPL-E's Java, TypeScript, PHP and C# shapes (its dataset_builder translators): class Problem, imports,
    # test harness; the Java item returns a javatuples Pair, so the jar must be on the class path.
    "qk_multiple_java": [
        dict(
            language="java",
            prompt=JAVA_IMPORTS + "class Problem {\n    // Sum and difference of a and b.\n"
            "    public static Pair<Long, Long> sumDiff(long a, long b) {\n",
            tests="    }\n    public static void main(String[] args) {\n"
            "    assert(sumDiff((3l), (1l)).equals((Pair.with(4l, 2l))));\n    }\n\n}\n",
            reference="        return Pair.with(a + b, a - b);",
        )
    ],
    "qk_multiple_ts": [
        dict(
            language="ts",
            prompt="//Sum of a and b.\nfunction add(a: number, b: number): number {\n",
            tests="declare var require: any;\nconst assert = require('node:assert');\n\n\nfunction test() {\n"
            "  let candidate = add;\n  assert.deepEqual(candidate(1, 2),3);\n}\n\ntest();",
            reference="  return a + b;\n}",
        )
    ],
    "qk_multiple_php": [
        dict(
            language="php",
            prompt="<?php\n// Sum of a and b.\nfunction add($a, $b) {\n",
            tests="function candidate(...$args) {\n    return add(...$args);\n}\n\nfunction test(): void {\n"
            '    if (candidate(1, 2) !== 3) { throw new Exception("Test failed!"); }\n}\n\ntest();',
            reference="    return $a + $b;\n}",
        )
    ],
    "qk_multiple_cs": [
        dict(
            language="cs",
            prompt=CS_USINGS + "class Problem {\n    // Sum of a and b.\n"
            "    public static long Add(long a, long b) {\n",
            tests="    }\n    public static void Main(string[] args) {\n    Debug.Assert(Add((1L), (2L)) == "
            "(3L));\n    }\n\n}\n",
            reference="        return a + b;",
        )
    ],
}


def test_full_suite_names_exist_in_lm_eval_registry():
    suite = load_suite("full")  # an alias of table2
    manager = TaskManager(include_path=[str(p) for p in TASK_CONFIGS[suite.task_configs]])
    missing = [t for t in suite.tasks(allow_code=True) if t not in manager.all_tasks]
    assert missing == []


def _fixture_task(name: str) -> ConfigurableTask:
    path = TASKS_DIR / "full" / f"{name}.yaml"
    config = load_yaml(path)
    docs = FIXTURES[name]
    config["custom_dataset"] = lambda **_: {config["test_split"]: Dataset.from_list(docs)}
    return ConfigurableTask(config=config)


@pytest.fixture(scope="module")
def small_task_manager():
    """simple_evaluate builds lm-eval's full registry (~10 s) unless given one; ours is never looked up."""
    return TaskManager(include_path=str(TASKS_DIR / "full"), include_defaults=False)


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_own_full_configs_render_and_score(name, small_task_manager, monkeypatch):
    language = FIXTURES[name][0].get("language")
    if language and (missing := missing_tools(language)):
        pytest.skip(f"{name} executes programs with {missing}, system tools (`make setup-toolchains`) absent here")
    extract()  # qk_mbpp_full's few-shot exemplars come from the offline extraction
    monkeypatch.setenv(ALLOW_ENV, "1")
    doc = FIXTURES[name][0]
    prompt = _fixture_task(name).fewshot_context(_fixture_task(name).test_docs()[0], num_fewshot=0)
    assert (doc.get("question") or doc.get("text") or doc.get("prompt")) in prompt
    for gold, expected in ((True, 1.0), (False, 0.0)):
        out = lm_eval.simple_evaluate(
            model=ReferenceLM(gold),
            tasks=[_fixture_task(name)],
            confirm_run_unsafe_code=True,
            bootstrap_iters=0,
            task_manager=small_task_manager,
        )
        result = out["results"][name]
        (key,) = [k for k in result if "," in k and "_stderr" not in k]
        assert result[key] == expected, (name, gold, out["samples"][name][0]["filtered_resps"])
