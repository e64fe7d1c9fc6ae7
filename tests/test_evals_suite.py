"""The smoke suite end to end on the tiny checkpoint through lm-eval's vllm backend; suite/CLI errors."""

import argparse
import json

import pytest

from quantkit.evals.extract import extract
from quantkit.evals.suite import add_eval_parser, evaluate, load_suite


def test_smoke_suite_through_vllm_writes_stamped_results_and_samples(tiny_checkpoint, tmp_path):
    extract()
    results = evaluate(tiny_checkpoint, suite="smoke", backend="vllm", out_dir=tmp_path, allow_code=True)

    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["suite"]["name"] == "smoke" and on_disk["suite"]["version"] == 1
    assert on_disk["seeds"]["vllm"] == 1234 and on_disk["model"]["path"] == str(tiny_checkpoint.resolve())
    smoke = load_suite("smoke")
    assert set(on_disk["benchmarks"]) == set(smoke.benchmarks)
    for task in smoke.tasks(allow_code=True):
        lines = (tmp_path / "samples" / f"{task}.jsonl").read_text().splitlines()
        expected = min(4, {"qk_mbpp": 3}.get(task, 4))
        assert len(lines) == expected == results["tasks"][task]["n"], task
        record = json.loads(lines[0])
        assert record["score"] in (0, 1) and record["prompt"] and record["task"] == task
        assert 0.0 <= results["tasks"][task]["score"] <= 1.0


def test_a_chat_suite_renders_prompts_through_the_models_chat_template(tiny_checkpoint, tmp_path):
    """The code suite (`chat_template: true`): each prompt is the model's chat template around the instruction,
    the answer opened by the task's gen_prefix (the problem's prompt inside a Python fence); a model without a
    chat template is refused by name before any engine starts."""
    import shutil

    extract()
    with pytest.raises(ValueError, match=r"chat template, and .* has none"):
        evaluate(tiny_checkpoint, suite="code", out_dir=tmp_path / "refused", limit=1, allow_code=True)
    model = tmp_path / "chat-model"
    shutil.copytree(tiny_checkpoint, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if not loop.last or add_generation_prompt %}<|end|>"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    results = evaluate(model, suite="code", out_dir=tmp_path / "eval", limit=1, allow_code=True)
    assert results["suite"]["chat_template"] is True and results["tasks"]["qk_humaneval_instruct"]["n"] == 1
    # the pooled Avg column: both tasks' items (each task run once), their item-weighted mean
    tasks, pooled = results["tasks"], results["benchmarks"]["HumanEval+MBPP"]
    assert set(tasks) == {"qk_humaneval_instruct", "qk_mbpp_500_instruct"} and pooled["n"] == 2
    assert pooled["score"] == (tasks["qk_humaneval_instruct"]["score"] + tasks["qk_mbpp_500_instruct"]["score"]) / 2
    record = json.loads((tmp_path / "eval" / "samples" / "qk_humaneval_instruct.jsonl").read_text().splitlines()[0])
    assert record["prompt"].startswith("<|user|>Write a solution to the following problem"), record["prompt"][:200]
    assert "<|end|><|assistant|>Here is the completed function:\n```python\nfrom typing import List" in record["prompt"]
    assert not record["prompt"].endswith("<|end|>") and record["score"] in (0, 1)
    with pytest.raises(ValueError, match=r"benchmarks \['Both'\] hold tasks of `code` benchmarks"):
        (tmp_path / "mixed.yaml").write_text(  # a pooled column that would run code without allow_code
            "name: b\nversion: 1\ndescription: d\ntask_configs: mini\ncode: [HumanEval]\n"
            "benchmarks: {HumanEval: [qk_humaneval_instruct], Both: [qk_humaneval_instruct, qk_mbpp_500_instruct]}\n"
        )
        load_suite(tmp_path / "mixed.yaml")
    with pytest.raises(ValueError, match="chat_template must be true or false"):
        (tmp_path / "bad.yaml").write_text(
            "name: b\nversion: 1\ndescription: d\ntask_configs: mini\n"
            "benchmarks: {HumanEval: [qk_humaneval_instruct]}\nchat_template: yes please\n"
        )
        load_suite(tmp_path / "bad.yaml")


def test_unknown_suite_and_cli_parser():
    with pytest.raises(ValueError, match="unknown suite 'nope'"):
        load_suite("nope")
    parser = argparse.ArgumentParser()
    add_eval_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", "some/model", "--suite", "smoke", "--limit", "2", "--allow-code-execution"])
    assert (args.suite, args.limit, args.allow_code_execution, args.backend) == ("smoke", 2, True, "vllm")
