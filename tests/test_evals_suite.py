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


def test_unknown_suite_and_cli_parser():
    with pytest.raises(ValueError, match="unknown suite 'nope'"):
        load_suite("nope")
    parser = argparse.ArgumentParser()
    add_eval_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eval", "some/model", "--suite", "smoke", "--limit", "2", "--allow-code-execution"])
    assert (args.suite, args.limit, args.allow_code_execution, args.backend) == ("smoke", 2, True, "vllm")
