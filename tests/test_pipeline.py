"""The deployment study end to end on a tiny checkpoint: quantize -> vLLM + lm-eval (smoke suite) -> degradation ->
results.json -> report; cached re-runs, resume after a crash, failures naming their stage; and the CI gate against
the committed baseline (tests/baselines/tiny_study_results.json), which an injected regression turns red.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.pipelines.study import StageError, Study, load_spec

pytestmark = pytest.mark.slow

BASELINE_RESULTS = Path(__file__).parent / "baselines" / "tiny_study_results.json"
SPEC = """
name: tiny
models: {{tiny: {model}}}
recipes: [bf16, w4a4_nvfp4]
eval: {{suite: smoke, limit: 3, dtype: float32, numerics: {numerics}}}
kl: {{num_sequences: 4, seq_len: 64}}
quality: {{num_sequences: 4, seq_len: 64}}
runs_dir: {runs}
"""


def _spec(tmp_path: Path, model: Path, numerics: str = "false") -> Path:
    """The tiny study's spec; `numerics` (eval.numerics, YAML) adds the numerics stage (this module's study: both
    rows; the crash-safety and Ray tests, which reuse the spec, leave it out: engines fewer each)."""
    path = tmp_path / "tiny.yaml"
    path.write_text(SPEC.format(model=model, runs=tmp_path / "runs", numerics=numerics))
    return path


def _mtimes(run_dir: Path) -> dict[str, float]:
    """Modification times of the cached stage artifacts (the report is re-rendered on every run)."""
    return {
        str(p.relative_to(run_dir)): p.stat().st_mtime_ns
        for stage in ("checkpoints", "evals", "degradation", "quality")
        for p in (run_dir / stage).rglob("*")
        if p.is_file()
    }


@pytest.fixture(scope="module")
def study(tiny_checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("study")
    spec = load_spec(_spec(tmp, tiny_checkpoint, numerics="[bf16, w4a4_nvfp4]"))
    return Study(spec), Study(spec).run()


def test_study_writes_every_artifact(study):
    _, run_dir = study
    for path in (
        "spec.json",
        "checkpoints/tiny-bf16/config.json",
        "checkpoints/tiny-w4a4_nvfp4/config.json",
        "evals/tiny-bf16/results.json",
        "evals/tiny-w4a4_nvfp4/results.json",
        "degradation/tiny-w4a4_nvfp4.json",
        "quality/tiny-w4a4_nvfp4.json",
        "results.json",
        "report/report.md",
        "report/report.html",
        "report/report.csv",
        "report/report.json",
    ):
        assert (run_dir / path).exists(), path
    results = json.loads((run_dir / "results.json").read_text())
    rows = {r["recipe"]: r for r in results["rows"]}
    assert set(rows) == {"bf16", "w4a4_nvfp4"} and rows["w4a4_nvfp4"]["precision"] == "W4A4"
    assert set(rows["bf16"]["scores"]) == {"MMLU", "MMMLU", "GSM8k", "MGSM", "Math"}  # code benchmarks need the opt-in
    quantized = rows["w4a4_nvfp4"]
    assert quantized["kl"] > 0 and set(quantized["noise_floor"]) == set(quantized["scores"])
    assert all(0.0 <= f <= 1.0 for f in quantized["flips"].values())
    # the KL comes from the eval engines' own logprobs of the held-out windows (full vocabulary, 4 x 64 tokens)
    kl = json.loads((run_dir / "degradation" / "tiny-w4a4_nvfp4.json").read_text())["kl"]
    assert (kl["source"], kl["mode"], kl["tokens"]) == ("vllm", "full", 4 * 64) and kl["mean"] == quantized["kl"]
    for recipe in ("bf16", "w4a4_nvfp4"):
        evaluated = json.loads((run_dir / "evals" / f"tiny-{recipe}" / "results.json").read_text())
        assert evaluated["heldout_logprobs"]["mode"] == "full"
        assert (run_dir / "evals" / f"tiny-{recipe}" / evaluated["heldout_logprobs"]["file"]).exists()
    timings = results["meta"]["timings"]  # wall seconds per stage, also in timings.json and the report
    assert list(timings["stages"]) == [
        "checkpoint",
        "diagnose",
        "quantize",
        "eval",
        "numerics",
        "degradation",
        "quality",
    ]
    assert timings["total"] == pytest.approx(sum(timings["stages"].values()), abs=0.05)
    assert {(e["stage"], e["recipe"]) for e in timings["entries"] if not e["cached"]} >= {
        ("eval", "bf16"),
        ("eval", "w4a4_nvfp4"),
    }
    # peak memory per measured stage (GiB): at least the study process's own resident set, which holds torch
    measured = [e for e in timings["entries"] if not e["cached"]]
    assert all(e["peak_gib"] > 0.1 for e in measured), measured
    assert timings["peak_gib"] == {
        stage: max(e["peak_gib"] for e in measured if e["stage"] == stage) for stage in {e["stage"] for e in measured}
    }
    assert "Time: checkpoint" in (run_dir / "report" / "report.md").read_text()
    assert "; peak memory: " in (run_dir / "report" / "report.md").read_text()


def test_numerics_floor_and_verdicts_in_words(study):
    """eval.numerics [bf16, w4a4_nvfp4]: each row's checkpoint evaluated again with QUANTKIT_CPU_SUMMATION=permute-k
    (recorded in its host record, and restored afterwards), paired item by item with its own eval: each row's
    numerics floor; the W4A4 row judged against BF16 (a Holm family of one) and held to the larger of the two floors;
    the verdicts opening the report. The tiny study runs in float32, whose unquantized Linears the second order does
    not touch (the W4A4 row's emulated Linears it does), so no claim is made here about the size of a floor
    (tests/test_cpu_linear.py and tests/test_quant_method_kernels.py check the order itself)."""
    import os

    from quantkit.serve.cpu.linear import SUMMATION_ENV

    _, run_dir = study
    assert SUMMATION_ENV not in os.environ
    again = json.loads((run_dir / "evals" / "tiny-bf16-numerics" / "results.json").read_text())
    first = json.loads((run_dir / "evals" / "tiny-bf16" / "results.json").read_text())
    assert again["host"]["summation"] == "permute-k" and first["host"]["summation"] == "default"
    assert first["host"]["isa"] and "heldout_logprobs" not in again
    verdicts = json.loads((run_dir / "results.json").read_text())["meta"]["verdicts"]
    tiny = verdicts["models"]["tiny"]
    items = sum(b["n"] for b in first["benchmarks"].values())
    assert tiny["numerics"]["n"] == items and tiny["numerics_floor"] >= 0 and tiny["numerics"]["order"] == "permute-k"
    row = tiny["vs_bf16"]["w4a4_nvfp4"]
    assert row["family"] == 1 and row["p_holm"] == row["p_two_sided"] and row["n"] == items
    again_w4a4 = json.loads((run_dir / "evals" / "tiny-w4a4_nvfp4-numerics" / "results.json").read_text())
    own = tiny["row_numerics"]["w4a4_nvfp4"]
    assert again_w4a4["host"]["summation"] == "permute-k" and own["n"] == items and own["order"] == "permute-k"
    own_floor = max(abs(own["ci_low"]), abs(own["ci_high"]))
    assert row["numerics_floor"] == max(tiny["numerics_floor"], own_floor)
    assert tiny["vs_baseline"] == {}  # plain W4A4 has no method baseline
    md = (run_dir / "report" / "report.md").read_text()
    assert (
        "## Verdicts" in md
        and "tiny: numerics floor ±" in md
        and "summation order (permute-k) flips" in md
        and "tiny W4A4: ΔAvg" in md
        and "tiny W4A4: its own numerics floor ±" in md
    )
    quantized = json.loads((run_dir / "evals" / "tiny-w4a4_nvfp4" / "results.json").read_text())
    history = json.loads((run_dir / "history.json").read_text())
    assert (
        history["tiny w4a4_nvfp4"][-1]["date"] == quantized["date"]
        and history["tiny bf16"][-1]["date"] == first["date"]
    )


def test_cached_rerun_and_resume_after_crash(study):
    studied, run_dir = study
    before = _mtimes(run_dir)
    studied.run()
    assert _mtimes(run_dir) == before, "a re-run must not redo finished stages"

    timings = json.loads((run_dir / "timings.json").read_text())["entries"]
    assert all(e["cached"] for e in timings if e["stage"] not in ("checkpoint", "report")), timings

    # a crash (SIGKILL) in the middle of the W4A4 eval: no evals/tiny-w4a4_nvfp4, only its writer's temp dir
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = run_dir / "evals" / f".tiny-w4a4_nvfp4.{dead.pid}.x1y2z3.tmp"
    (run_dir / "evals" / "tiny-w4a4_nvfp4").rename(leftover)
    (leftover / "results.json").unlink()
    (run_dir / "degradation" / "tiny-w4a4_nvfp4.json").unlink()
    studied.run()
    after = _mtimes(run_dir)
    redone = {k for k in after if after[k] != before.get(k)}
    assert "evals/tiny-w4a4_nvfp4/results.json" in redone and "degradation/tiny-w4a4_nvfp4.json" in redone
    assert not any(k.startswith(("evals/tiny-bf16", "checkpoints/")) for k in redone), redone
    assert not leftover.exists()
    redone_eval = json.loads((run_dir / "evals" / "tiny-w4a4_nvfp4" / "results.json").read_text())
    assert redone_eval["out_dir"] == str((run_dir / "evals" / "tiny-w4a4_nvfp4").resolve())


def test_a_partial_run_reports_the_rows_so_far(study, tmp_path):
    """A run stopped before its W4A4 row was measured: results.json holds the bf16 row and names the pending one,
    and the report says so."""
    studied, run_dir = study
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(copy / "evals" / "tiny-w4a4_nvfp4")
    partial = Study(studied.spec, copy)
    partial._report()
    results = json.loads((copy / "results.json").read_text())
    assert [r["recipe"] for r in results["rows"]] == ["bf16"] and results["meta"]["pending"] == ["tiny w4a4_nvfp4"]
    assert (
        "Pending: 1 row (tiny w4a4_nvfp4): the study is still running or was stopped."
        in (copy / "report" / "report.md").read_text()
    )


def test_a_cached_eval_of_another_suite_version_is_refused(study, tmp_path):
    """A found evaluation made under another version of its suite (or another item limit) is not reused beside the
    new one: the run stops with a bad-input StageError naming the file, both versions and the way out."""
    studied, run_dir = study
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns(".lock"))
    results = copy / "evals" / "tiny-bf16" / "results.json"
    record = json.loads(results.read_text())
    version = record["suite"]["version"]
    record["suite"]["version"] = version - 1
    results.write_text(json.dumps(record))
    with pytest.raises(
        StageError,
        match=rf"evaluated on suite smoke v{version - 1} \(limit 3\); this spec runs "
        rf"smoke v{version} \(limit 3\): move that directory aside",
    ) as err:
        Study(studied.spec, copy).run()
    assert err.value.bad_input and str(results) in str(err.value)


def test_a_cached_eval_of_other_cpu_kernels_is_refused(study, tmp_path):
    """Every vLLM evaluation records the CPU kernels that summed it (`cpu_kernels`); a found one computed with other
    kernels (another summation order: the quantkit of before 2026-12-02 on an AMD AVX-512 BF16 CPU, or another
    switch setting) is not mixed into the report: a bad-input StageError naming the file, both and the switches.
    One recording none is taken as computed by the kernels quantkit chose before (`amd_preference=False`)."""
    from quantkit.serve.cpu.linear import cpu_kernels

    studied, run_dir = study
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns(".lock"))
    results = copy / "evals" / "tiny-bf16" / "results.json"
    record = json.loads(results.read_text())
    assert record["cpu_kernels"] == cpu_kernels()
    record["cpu_kernels"] = {"half_linear": "float32>=64", "float32_gemm": "nowhere"}
    results.write_text(json.dumps(record))
    with pytest.raises(StageError, match=r"computed with CPU kernels .*'nowhere'.*QUANTKIT_CPU_FLOAT32_GEMM") as err:
        Study(studied.spec, copy).run()
    assert err.value.bad_input and str(results) in str(err.value)
    del record["cpu_kernels"]
    results.write_text(json.dumps(record))
    if cpu_kernels(amd_preference=False) == cpu_kernels():
        Study(studied.spec, copy).run()  # the same kernels as before: reused
    else:
        with pytest.raises(StageError, match="computed with CPU kernels"):
            Study(studied.spec, copy).run()


def test_the_report_shows_where_the_quantization_noise_sits(study):
    """results.json carries each model's per-projection SNR tables from its diagnose stage (meta.sensitivity, the
    per-layer values left out) and the report renders them: the kinds of the diagnosed W4A4 recipe, lowest mean
    first, each "mean (min @ layer)" as diagnostics.json has it."""
    from quantkit.report.render import SENSITIVITY_TITLE

    _, run_dir = study
    results = json.loads((run_dir / "results.json").read_text())
    table = results["meta"]["sensitivity"]["tiny"]["w4a4_nvfp4"]
    source = json.loads((run_dir / "diagnostics" / "tiny" / "diagnostics.json").read_text())["sensitivity"][
        "w4a4_nvfp4"
    ]
    assert list(table) == list(source) and table and all("layers" not in cell for cell in table.values())
    means = [cell["mean_db"] for cell in table.values()]
    assert means == sorted(means)
    kind, cell = next(iter(table.items()))
    for name in ("report.md", "report.html"):
        text = (run_dir / "report" / name).read_text()
        assert (
            SENSITIVITY_TITLE in text
            and f"{cell['mean_db']:.1f} ({cell['min_db']:.1f} @ {cell['worst_layer']})" in text
        )
        assert kind in text


def test_the_report_shows_where_each_rows_noise_remains(study):
    """The quality stage measures each quantized row's checkpoint against its source (`quantkit quality` on the
    spec's windows): results.json carries its per-projection and per-block tables (meta.checkpoint_sensitivity,
    meta.checkpoint_block_sensitivity; the per-layer values left out) and the report renders each in its own
    section, each cell "mean (min @ layer)" of the artifact."""
    from quantkit.report.render import BLOCK_SENSITIVITY_TITLE, CHECKPOINT_SENSITIVITY_TITLE

    _, run_dir = study
    measured = json.loads((run_dir / "quality" / "tiny-w4a4_nvfp4.json").read_text())
    assert (measured["num_sequences"], measured["seq_len"]) == (4, 64) and measured["recipe"] == "w4a4_nvfp4"
    quantized = json.loads((run_dir / "checkpoints" / "tiny-w4a4_nvfp4" / "config.json").read_text())
    assert set(measured["layer_snr_db"]) == set(quantized["quantization_config"]["quantized_modules"])
    table = json.loads((run_dir / "results.json").read_text())["meta"]["checkpoint_sensitivity"]["tiny"]["w4a4_nvfp4"]
    assert table == {kind: {k: v for k, v in c.items() if k != "layers"} for kind, c in measured["sensitivity"].items()}
    blocks = json.loads((run_dir / "results.json").read_text())["meta"]["checkpoint_block_sensitivity"]["tiny"]
    assert set(blocks["w4a4_nvfp4"]) == {"self_attn", "mlp"}  # and each block's section (BLOCK_SENSITIVITY_TITLE)
    kind, cell = next(iter(table.items()))
    block, block_cell = next(iter(blocks["w4a4_nvfp4"].items()))
    for name in ("report.md", "report.html"):
        text = (run_dir / "report" / name).read_text()
        section = text[text.index(CHECKPOINT_SENSITIVITY_TITLE) : text.index(BLOCK_SENSITIVITY_TITLE)]
        assert f"{cell['mean_db']:.1f} ({cell['min_db']:.1f} @ {cell['worst_layer']})" in section and kind in section
        section = text[text.index(BLOCK_SENSITIVITY_TITLE) :]
        assert f"{block_cell['mean_db']:.1f} ({block_cell['min_db']:.1f} @ {block_cell['worst_layer']})" in section
        assert block in section


def test_deleted_checkpoints_are_recreated_and_evals_kept(study, tmp_path):
    """A run directory whose checkpoints were deleted (to save disk) while its evals were kept: the re-run reports
    each row only once its checkpoint is back (the report reads sizes and calibration from it), re-creates the
    checkpoints and keeps every eval."""
    studied, run_dir = study
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(copy / "checkpoints")
    evals_before = {k: v for k, v in _mtimes(copy).items() if k.startswith("evals/")}
    partial = Study(studied.spec, copy)
    with pytest.raises(ValueError, match=r"no row .* is measured yet"):
        partial._report()
    partial.run()
    assert {k: v for k, v in _mtimes(copy).items() if k.startswith("evals/")} == evals_before
    for recipe in ("bf16", "w4a4_nvfp4"):
        assert (copy / "checkpoints" / f"tiny-{recipe}" / "config.json").exists()
    results = json.loads((copy / "results.json").read_text())
    assert [r["recipe"] for r in results["rows"]] == ["bf16", "w4a4_nvfp4"] and results["meta"]["pending"] == []
    original = json.loads((run_dir / "results.json").read_text())
    assert [r["scores"] for r in results["rows"]] == [r["scores"] for r in original["rows"]]


def test_failures_name_stage_model_and_recipe(tmp_path, tiny_checkpoint):
    from quantkit.diagnose.run import diagnose, write_diagnostics

    broken = tmp_path / "broken"  # a checkpoint without its tokenizer
    shutil.copytree(tiny_checkpoint, broken)
    (broken / "tokenizer.json").unlink()
    (broken / "tokenizer_config.json").unlink()
    study = Study(load_spec(_spec(tmp_path, broken)))
    # the bf16 row comes first (rows arrive early), so its quantize stage is the first to need the tokenizer
    with pytest.raises(StageError, match=r"stage 'quantize' failed for model 'tiny' recipe 'bf16' \(.*tokenizer"):
        study.run(until="quantize")
    with pytest.raises(StageError, match=r"stage 'diagnose' failed for model 'tiny' \(.*tokenizer"):
        study.run(until="diagnose")
    # with the diagnose stage finished, `--until diagnose` has nothing left to fail
    write_diagnostics(
        diagnose(tiny_checkpoint, num_sequences=2, seq_len=32, recipes=[], progress=False),
        study.dir / "diagnostics" / "tiny",
    )
    study.run(until="diagnose")
    bad = tmp_path / "bad.yaml"
    bad.write_text(SPEC.format(model=tiny_checkpoint, runs=tmp_path, numerics="false").replace("w4a4_nvfp4", "w3a3"))
    with pytest.raises(ValueError, match="unknown recipe 'w3a3'"):
        load_spec(bad)


def test_gate_against_committed_baseline_and_injected_regression(study, tmp_path):
    """CI's gate: the tiny study passes against the committed baseline; a checkpoint quantized with a broken
    rounding (every E2M1 code one step smaller in magnitude, as a rounding bug would do) fails it."""
    from quantkit.report.gate import load_thresholds, run_gate

    _, run_dir = study
    assert run_gate(BASELINE_RESULTS, run_dir / "results.json", load_thresholds()) == 0

    regressed = tmp_path / "regressed"
    shutil.copytree(run_dir, regressed, ignore=shutil.ignore_patterns("cache"))
    for stale in ("evals/tiny-w4a4_nvfp4", "degradation", "results.json"):
        target = regressed / stale
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    weights = regressed / "checkpoints" / "tiny-w4a4_nvfp4" / "model.safetensors"
    state = load_file(weights)
    for name, tensor in state.items():
        if name.endswith("weight_packed"):
            low, high = tensor & 0x0F, tensor >> 4
            shrink = lambda code: torch.where(code & 0x7 > 0, code - 1, code)  # noqa: E731
            state[name] = (shrink(low) | shrink(high) << 4).to(torch.uint8)
    save_file(state, weights)
    Study(
        load_spec(_spec(tmp_path, Path(json.loads((run_dir / "spec.json").read_text())["models"]["tiny"]))), regressed
    ).run()
    assert run_gate(BASELINE_RESULTS, regressed / "results.json", load_thresholds()) == 1
    # the re-evaluated W4A4 row is on record once more (earlier tests of this module may have redone it too); the
    # report names it as moved exactly when its Avg changed from the evaluation before
    runs = json.loads((regressed / "history.json").read_text())["tiny w4a4_nvfp4"]
    latest = json.loads((regressed / "evals" / "tiny-w4a4_nvfp4" / "results.json").read_text())["date"]
    verdicts = json.loads((regressed / "results.json").read_text())["meta"]["verdicts"]["models"]["tiny"]
    assert len(runs) >= 2 and runs[-1]["date"] == latest != runs[-2]["date"]
    moved = [m["row"] for m in verdicts.get("moved", [])]
    assert moved == (["tiny w4a4_nvfp4"] if runs[-2]["avg"] != runs[-1]["avg"] else [])


def test_every_shipped_pipeline_spec_loads_with_suites_that_exist():
    """Each pipelines/*.yaml validates (keys, recipes, baseline) and names, for every model, a suite that loads:
    a typo in a spec a user runs for hours fails here, not after its first stages."""
    from quantkit.evals.suite import load_suite

    specs = sorted((Path(__file__).resolve().parents[1] / "pipelines").glob("*.yaml"))
    assert len(specs) >= 10
    for path in specs:
        study = Study(load_spec(path))
        for label in study.spec.models:
            assert load_suite(study.suite(label)).tasks(allow_code=True), f"{path.name}: {label}'s suite has no tasks"
