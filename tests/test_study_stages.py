"""The study's stage table (pipelines/study.py STAGES) and what derives from it, without running a stage that
needs vLLM: targets per scope, artifact paths, `quantkit run --until`, the Makefile's study targets, and the
eval stage's servability check before any work."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from quantkit.checkpoints import CheckpointError
from quantkit.cli import main
from quantkit.pipelines.study import SCOPES, STAGE_BY_NAME, STAGE_NAMES, STAGES, Stage, Study, StudySpec

REPO = Path(__file__).resolve().parents[1]


def _study(tmp_path: Path) -> Study:
    return Study(
        StudySpec(name="t", models={"a": "zoo:ga", "b": "zoo:gatednorm"}, recipes=["bf16", "w4a4_nvfp4"]),
        tmp_path / "run",
    )


def test_the_table_in_order_with_scopes_and_artifacts():
    assert STAGE_NAMES == (
        "checkpoint",
        "diagnose",
        "quantize",
        "eval",
        "numerics",
        "reference",
        "degradation",
        "quality",
        "report",
    )
    assert {s.name: s.scope for s in STAGES} == {
        "checkpoint": "model",
        "diagnose": "model",
        "quantize": "recipe",
        "eval": "recipe",
        "numerics": "asked",
        "reference": "asked",
        "degradation": "quantized",
        "quality": "quantized",
        "report": "study",
    }
    assert all(s.scope in SCOPES and callable(s.run) for s in STAGES) and STAGE_BY_NAME["eval"] is STAGES[3]
    with pytest.raises(ValueError, match="unknown scope 'per_layer'"):
        Stage("x", "per_layer", None, Study._report)


def test_targets_follow_each_scope(tmp_path):
    study = _study(tmp_path)
    assert study.targets(STAGE_BY_NAME["diagnose"]) == [("a", None), ("b", None)]
    assert study.targets(STAGE_BY_NAME["eval"]) == [
        ("a", "bf16"),
        ("a", "w4a4_nvfp4"),
        ("b", "bf16"),
        ("b", "w4a4_nvfp4"),
    ]
    assert study.targets(STAGE_BY_NAME["degradation"]) == [("a", "w4a4_nvfp4"), ("b", "w4a4_nvfp4")]
    assert study.targets(STAGE_BY_NAME["report"]) == [(None, None)]
    assert study.targets(STAGE_BY_NAME["numerics"]) == [] and study.targets(STAGE_BY_NAME["reference"]) == []
    assert study.targets(STAGE_BY_NAME["quality"]) == []  # only where the spec asks


def test_the_quality_stage_runs_where_the_spec_asks_on_checkpoints_it_reads(tmp_path):
    """With `quality`, each quantized row quantkit made gets the quality stage right after its degradation, and so
    does a peer's row `quantkit quality` reads (llm-compressor's NVFP4, `recipe.quality_reads`); a peer's FP8-block or
    ModelOpt row does not, nor one whose SpinQuant rotations are folded into it (its layers no longer read the
    source's stream: quality refuses such a checkpoint, tests/test_errors.py)."""
    spec = StudySpec(
        name="t",
        models={"a": "zoo:ga"},
        recipes=["bf16", "w4a4_nvfp4", "nvfp4_ct_awq", "fp8_block_ct", "nvfp4_modelopt", "nvfp4_ct_spinquant16_gptq"],
        quality=dict(num_sequences=4, seq_len=64),
    )
    study = Study(spec, tmp_path / "run")
    assert study.targets(STAGE_BY_NAME["quality"]) == [("a", "w4a4_nvfp4"), ("a", "nvfp4_ct_awq")]
    work = [(stage.name, label, recipe) for stage, label, recipe in study.work(STAGES)]
    at = work.index(("degradation", "a", "w4a4_nvfp4"))
    assert work[at + 1] == ("quality", "a", "w4a4_nvfp4")
    for peer in ("fp8_block_ct", "nvfp4_modelopt", "nvfp4_ct_spinquant16_gptq"):
        assert ("quality", "a", peer) not in work and ("degradation", "a", peer) in work
    assert study.artifact("quality", "a", "w4a4_nvfp4") == study.dir / "quality" / "a-w4a4_nvfp4.json"


@pytest.mark.parametrize(
    "value,message",
    [
        ("[4, 64]", "quality must be a mapping of num_sequences and seq_len"),
        ("{windows: 4}", r"unknown quality key\(s\) \['windows'\]"),
        ("{num_sequences: 0}", "quality.num_sequences must be a positive integer, not 0"),
        ("{seq_len: 64.0}", "quality.seq_len must be a positive integer, not 64.0"),
    ],
)
def test_bad_quality_settings_are_refused_by_name(tmp_path, value, message):
    from quantkit.pipelines.study import load_spec

    path = tmp_path / "s.yaml"
    path.write_text(f"name: s\nmodels: {{a: zoo:ga}}\nrecipes: [bf16, w4a4_nvfp4]\nquality: {value}\n")
    with pytest.raises(ValueError, match=message):
        load_spec(path)
    path.write_text("name: s\nmodels: {a: zoo:ga}\nrecipes: [bf16, w4a4_nvfp4]\nquality: {}\n")
    assert load_spec(path).quality == {"num_sequences": 16, "seq_len": 256}


def test_baseline_stages_run_where_the_spec_asks(tmp_path):
    """numerics (eval.numerics) for every model's bf16 row, right after its eval; reference (eval.reference) only for
    a trained model whose makers publish a score in a protocol quantkit runs (the coder: HumanEval, code-evalplus)."""
    spec = StudySpec(
        name="t",
        models={"a": "zoo:ga", "coder": "model:qwen2.5-coder-0.5b-instruct"},
        recipes=["bf16", "w4a4_nvfp4"],
        eval=dict(numerics=True, reference=True),
    )
    study = Study(spec, tmp_path / "run")
    assert study.targets(STAGE_BY_NAME["numerics"]) == [("a", "bf16"), ("coder", "bf16")]
    assert study.targets(STAGE_BY_NAME["reference"]) == [("coder", "bf16")]
    assert study.reference("coder").suite == "code-evalplus" and study.reference("a") is None
    work = [(stage.name, label, recipe) for stage, label, recipe in study.work(STAGES)]
    assert work[:5] == [
        ("checkpoint", "a", None),
        ("quantize", "a", "bf16"),
        ("eval", "a", "bf16"),
        ("numerics", "a", "bf16"),
        ("diagnose", "a", None),
    ]
    coder_bf16 = work.index(("eval", "coder", "bf16"))
    assert work[coder_bf16 + 1 : coder_bf16 + 3] == [("numerics", "coder", "bf16"), ("reference", "coder", "bf16")]
    assert study.artifact("numerics", "a", "bf16") == study.dir / "evals" / "a-bf16-numerics" / "results.json"
    assert study.reference_dir("coder") == study.dir / "evals" / "coder-bf16-reference"


def test_numerics_runs_for_the_rows_the_spec_names(tmp_path):
    """eval.numerics as a list: the numerics stage for each named row (a quantized row's own floor), right after
    that row's eval, in its own directory; rows not named get none; reference stays on bf16 only."""
    spec = StudySpec(
        name="t",
        models={"a": "zoo:ga"},
        recipes=["bf16", "w4a4_nvfp4", "w4a4_nvfp4_gptq"],
        eval=dict(numerics=["bf16", "w4a4_nvfp4"], reference=True),
    )
    study = Study(spec, tmp_path / "run")
    assert study.numerics_rows() == ["bf16", "w4a4_nvfp4"]
    assert study.targets(STAGE_BY_NAME["numerics"]) == [("a", "bf16"), ("a", "w4a4_nvfp4")]
    assert study.targets(STAGE_BY_NAME["reference"]) == []  # zoo:ga publishes no score
    work = [(stage.name, label, recipe) for stage, label, recipe in study.work(STAGES)]
    w4a4 = work.index(("eval", "a", "w4a4_nvfp4"))
    assert work[w4a4 + 1] == ("numerics", "a", "w4a4_nvfp4")
    assert ("numerics", "a", "w4a4_nvfp4_gptq") not in work
    assert study.numerics_dir("a", "w4a4_nvfp4") == study.dir / "evals" / "a-w4a4_nvfp4-numerics"
    assert Study(StudySpec(name="t", models={"a": "zoo:ga"}, recipes=["bf16"]), tmp_path).numerics_rows() == []


def test_rows_arrive_early(tmp_path):
    """The local order measures each row as soon as its checkpoint exists and re-renders the report after it:
    the bf16 row (and the model's diagnostics) first, then each quantized chain; `--until` keeps that order."""
    study = _study(tmp_path)
    work = [(stage.name, label, recipe) for stage, label, recipe in study.work(STAGES)]
    assert work[:9] == [
        ("checkpoint", "a", None),
        ("quantize", "a", "bf16"),
        ("eval", "a", "bf16"),
        ("diagnose", "a", None),
        ("report", None, None),
        ("quantize", "a", "w4a4_nvfp4"),
        ("eval", "a", "w4a4_nvfp4"),
        ("degradation", "a", "w4a4_nvfp4"),
        ("report", None, None),
    ]
    assert len(work) == 18 and sorted(set(work)) == sorted({(s.name, *t) for s in STAGES for t in study.targets(s)})
    until_quantize = [(stage.name, label, recipe) for stage, label, recipe in study.work(STAGES[:3])]
    assert until_quantize[:4] == [
        ("checkpoint", "a", None),
        ("quantize", "a", "bf16"),
        ("diagnose", "a", None),
        ("quantize", "a", "w4a4_nvfp4"),
    ]
    assert study.left(study.work(STAGES)[-2:]) == "left: 1 degradation, 1 report (~0 min + stages not yet timed)"
    study.timings = {
        ("degradation", "a", "w4a4_nvfp4"): {"seconds": 90.0, "cached": False},
        ("report", "", ""): {"seconds": 30.0, "cached": False},
    }
    assert study.left(study.work(STAGES)[-2:]) == "left: 1 degradation, 1 report (~2 min)"
    assert study.expected("degradation") == ", expect ~1.5 min (mean of 1 earlier degradation stage)"
    assert study.expected("eval") == ""  # nothing measured: no promise
    # a resumed run finds the stages done: they keep the seconds of the run that made them, and still predict
    study.timings = {k: {**t, "cached": True} for k, t in study.timings.items()}
    study.timings[("eval", "a", "bf16")] = {"seconds": 0.0, "cached": True}  # done, its time unknown
    assert study.left(study.work(STAGES)[-2:]) == "left: 1 degradation, 1 report (~2 min)"
    assert study.expected("eval") == ""


def test_a_resumed_run_renders_the_report_only_where_something_changed(tmp_path, monkeypatch):
    """`Study.run` locally: the report renders at its first place in the order (this run's spec), after a stage
    that ran, and at the end; a report whose preceding stages were all cached would render the same rows again."""
    study = _study(tmp_path)
    work = [(stage.name, label, recipe) for stage, label, recipe in study.work(STAGES)]
    assert [i for i, w in enumerate(work) if w[0] == "report"] == [4, 8, 13, 17]
    done: list[tuple[str, str | None, str | None]] = []

    def do(self, stage, label, recipe):  # every stage cached but the first model's W4A4 evaluation
        done.append((stage.name, label, recipe))
        return (stage.name, label, recipe) == ("eval", "a", "w4a4_nvfp4")

    monkeypatch.setattr(Study, "_do", do)
    study.run()
    taken = _positions(work, done)
    assert len(taken) == len(done)  # done is work in order, with some reports left out
    assert [i for i in taken if work[i][0] != "report"] == [i for i, w in enumerate(work) if w[0] != "report"]
    assert sorted(i for i in taken if work[i][0] == "report") == [4, 8, 17]  # first, after the eval that ran, last


def _positions(work: list, done: list) -> set[int]:
    """The indices of `work` that `done` (a subsequence of it, in order) took."""
    out, i = set(), 0
    for n, w in enumerate(work):
        if i < len(done) and done[i] == w:
            out.add(n)
            i += 1
    return out


def test_artifacts_are_the_run_directory_layout(tmp_path):
    study = _study(tmp_path)
    run = study.dir
    assert study.artifact("checkpoint", "a") is None and study.artifact("report") is None  # always run
    assert study.artifact("diagnose", "a") == run / "diagnostics" / "a" / "diagnostics.json"
    assert study.artifact("quantize", "a", "bf16") == run / "checkpoints" / "a-bf16" / "config.json"
    assert study.artifact("eval", "b", "w4a4_nvfp4") == run / "evals" / "b-w4a4_nvfp4" / "results.json"
    assert study.artifact("degradation", "b", "w4a4_nvfp4") == run / "degradation" / "b-w4a4_nvfp4.json"
    assert study.checkpoint_dir("a", "bf16") == run / "checkpoints" / "a-bf16"
    assert (
        study.eval_dir("a", "bf16") == run / "evals" / "a-bf16"
        and study.diagnostics_dir("a") == run / "diagnostics" / "a"
    )


def test_until_takes_the_table_names(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(f"{s.name} ({SCOPES[s.scope]})" in help_text for s in STAGES), help_text
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--until", "serve"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'serve'" in err and all(name in err for name in STAGE_NAMES), err


def test_makefile_study_targets_name_stages_of_the_table():
    makefile = (REPO / "Makefile").read_text()
    untils = dict(re.findall(r"^(\w+):[^\n]*\n\t\$\(STUDY\) --until (\w+)$", makefile, flags=re.M))
    assert untils == {"quantize": "quantize", "eval": "report"}
    assert set(untils.values()) <= set(STAGE_NAMES)


def test_eval_checks_servability_before_any_work(tiny_checkpoint, tmp_path, monkeypatch):
    """A checkpoint vLLM would refuse fails the eval stage before the evaluator runs or its output's temp dir exists."""
    import quantkit.evals.suite

    study = _study(tmp_path)
    checkpoint = study.checkpoint_dir("a", "w4a4_nvfp4")
    shutil.copytree(tiny_checkpoint, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "quantkit", "format_version": 2}
    (checkpoint / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(quantkit.evals.suite, "evaluate", lambda *a, **k: pytest.fail("evaluate ran"))
    with pytest.raises(CheckpointError, match="format_version"):
        STAGE_BY_NAME["eval"].run(study, "a", "w4a4_nvfp4")
    assert not (study.dir / "evals").exists()


def test_a_method_row_is_judged_against_the_plain_recipe_of_its_format():
    """`method_baseline`: quantkit's methods against the plain round-to-nearest recipe of their scheme; a peer's
    NVFP4 / FP8-block rows against quantkit's plain recipe of the same weight format (`PEER_FORMATS`), Four Over Six
    (its own scheme, NVFP4's weight grid) against plain NVFP4; nothing for BF16, a plain recipe itself, a format
    quantkit has no plain recipe of, or a study without the plain one."""
    from quantkit.pipelines.study import method_baseline

    recipes = ["bf16", "w4a4_nvfp4", "w8a8_fp8_block", "w4a4_nvfp4_awq", "nvfp4_ct_awq", "fp8_block_ct"]
    assert method_baseline("w4a4_nvfp4_awq", recipes) == "w4a4_nvfp4"
    assert method_baseline("nvfp4_ct_awq", recipes) == "w4a4_nvfp4"
    assert method_baseline("fp8_block_ct", recipes) == "w8a8_fp8_block"
    assert method_baseline("mixed_fp8_attn_nvfp4", recipes) == "w4a4_nvfp4"
    assert method_baseline("w4a4_nvfp4_46", recipes) == "w4a4_nvfp4"  # Four Over Six: NVFP4's weights, a method
    for recipe in ("bf16", "w4a4_nvfp4"):
        assert method_baseline(recipe, recipes) is None
    assert method_baseline("fp8_pc_pt_modelopt", [*recipes, "fp8_pc_pt_modelopt"]) is None
    assert method_baseline("nvfp4_ct_awq", ["bf16", "nvfp4_ct_awq"]) is None
    from dataclasses import replace

    from quantkit.formats.constants import WeightScales
    from quantkit.quantize.recipe import load_recipe

    four_over_six_activations = replace(load_recipe("w4a4_nvfp4_46"), weight_scales=WeightScales.MINMAX)
    assert not four_over_six_activations.round_to_nearest  # min-max weights, but 4/6 activations: a method
