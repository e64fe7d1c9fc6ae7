"""A deployment study: models x recipes -> checkpoints -> vLLM + lm-eval -> degradation -> results.json -> report.

    quantkit run pipelines/default.yaml [--model MODEL] [--until STAGE]     (make quantize eval MODEL=...)

Spec (YAML, see pipelines/default.yaml):

    name: default
    models: {ga: "zoo:ga", ...}      # label -> source: zoo:<preset> | local checkpoint dir | hub id
    zoo: {size: tiny, dir: zoo}      # where zoo:<preset> checkpoints are built (cached)
    recipes: [bf16, w8a8_fp8_block, w4a4_nvfp4, w4a4_nvfp4_sq]   # bf16 is every model's baseline
    eval: {suite: mini, backend: vllm, limit: null, allow_code: false, seed: 1234, dtype: bfloat16}
    kl: {num_sequences: 16, seq_len: 128}
    diagnose: {num_sequences: 16, seq_len: 128}   # quantkit.diagnose on each source checkpoint
    parallel: {tensor_parallel_size: 1, data_parallel_size: 1}   # vLLM TP; lm-eval DP (engine replicas)
    runs_dir: runs

Run directory runs/<name>[-<model label>]/, every artifact written atomically (temp + rename), so its
presence means "done" and a re-run skips it; a run killed mid-way loses only the stage in flight:

    spec.json                       the resolved spec
    diagnostics/<label>/            `quantkit diagnose` of the source checkpoint (JSON, summary, figures)
    checkpoints/<label>-<recipe>/   `quantkit quantize` output (bf16 too: the baseline checkpoint)
    evals/<label>-<recipe>/         `quantkit.evals.suite.evaluate` output (results.json, samples/)
    degradation/<label>-<recipe>.json   flips, paired bootstrap (noise floor), held-out KL vs bf16
    results.json                    the report's input (docs/report-format.md)
    report/                         Markdown, CSV, JSON, HTML (quantkit.report)

A failing stage raises StageError naming the stage, model and recipe.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

from quantkit.atomic import write_text_atomic

logger = logging.getLogger(__name__)

STAGES = ("checkpoint", "diagnose", "quantize", "eval", "degradation", "report")
BASELINE = "bf16"
SPEC_KEYS = {"name", "models", "zoo", "recipes", "eval", "kl", "diagnose", "parallel", "runs_dir"}
EVAL_DEFAULTS = dict(suite="mini", backend="vllm", limit=None, allow_code=False, seed=1234, dtype="bfloat16")


class StageError(RuntimeError):
    """A stage failed; the message names stage, model and recipe, the cause is chained."""


@dataclass
class StudySpec:
    name: str
    models: dict[str, str]
    recipes: list[str]
    zoo: dict[str, Any] = field(default_factory=lambda: dict(size="tiny", dir="zoo"))
    eval: dict[str, Any] = field(default_factory=lambda: dict(EVAL_DEFAULTS))
    kl: dict[str, int] = field(default_factory=lambda: dict(num_sequences=16, seq_len=128))
    diagnose: dict[str, int] = field(default_factory=lambda: dict(num_sequences=16, seq_len=128))
    parallel: dict[str, int] = field(default_factory=lambda: dict(tensor_parallel_size=1, data_parallel_size=1))
    runs_dir: str = "runs"


def load_spec(path: str | Path, model: str | None = None) -> StudySpec:
    """Read and validate a spec; `model` (hub id | local dir | zoo:<preset>) replaces its models."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"pipeline spec {path} does not exist")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a pipeline spec is a YAML mapping")
    if unknown := sorted(set(data) - SPEC_KEYS):
        raise ValueError(f"{path}: unknown key(s) {unknown}; known: {sorted(SPEC_KEYS)}")
    for key in ("name", "models", "recipes"):
        if not data.get(key):
            raise ValueError(f"{path}: missing required key {key!r}")
    from quantkit.quantize.recipe import load_recipe

    for recipe in data["recipes"]:
        load_recipe(recipe)  # unknown names fail here, before any work
    if BASELINE not in data["recipes"]:
        raise ValueError(f"{path}: recipes must include {BASELINE!r}, the baseline every degradation is measured against")
    spec = StudySpec(**{k: v for k, v in data.items()})
    spec.parallel = {"tensor_parallel_size": 1, "data_parallel_size": 1, **(data.get("parallel") or {})}
    if unknown := sorted(set(spec.parallel) - {"tensor_parallel_size", "data_parallel_size"}):
        raise ValueError(f"{path}: unknown parallel key(s) {unknown}; known: tensor_parallel_size, data_parallel_size")
    spec.eval = {**EVAL_DEFAULTS, **(data.get("eval") or {})}
    if unknown := sorted(set(spec.eval) - set(EVAL_DEFAULTS)):
        raise ValueError(f"{path}: unknown eval key(s) {unknown}; known: {sorted(EVAL_DEFAULTS)}")
    if model is not None:
        label = model.removeprefix("zoo:") if model.startswith("zoo:") else Path(model.rstrip("/")).name
        spec.models = {label: model}
        spec.name = f"{spec.name}-{label}"
    return spec


def _atomic_json(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=1, default=str) + "\n")


def resolve_source(source: str, spec: StudySpec) -> Path:
    """zoo:<preset> -> built (or cached) zoo checkpoint; a local directory -> itself; else a hub id -> download."""
    if source.startswith("zoo:"):
        from quantkit.models import zoo

        return zoo.build(source[4:], size=spec.zoo.get("size", "tiny"), zoo_dir=spec.zoo.get("dir", "zoo"))
    path = Path(source)
    if path.exists():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a checkpoint directory (no config.json)")
        return path
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(f"{source!r} is neither zoo:<preset> nor a local directory, and the hub is off "
                                "(HF_HUB_OFFLINE=1): set HF_HUB_OFFLINE=0 with network access, or pass a local directory")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source))


class Study:
    """One run directory; `run()` does every missing stage for every (model, recipe), in order."""

    def __init__(self, spec: StudySpec, run_dir: str | Path | None = None) -> None:
        self.spec = spec
        self.dir = Path(run_dir) if run_dir is not None else Path(spec.runs_dir) / spec.name
        self.sources: dict[str, Path] = {}

    def checkpoint_dir(self, label: str, recipe: str) -> Path:
        return self.dir / "checkpoints" / f"{label}-{recipe}"

    def eval_dir(self, label: str, recipe: str) -> Path:
        return self.dir / "evals" / f"{label}-{recipe}"

    def degradation_file(self, label: str, recipe: str) -> Path:
        return self.dir / "degradation" / f"{label}-{recipe}.json"

    def run(self, until: str = "report") -> Path:
        """Run every stage up to `until` (inclusive); return the run directory."""
        if until not in STAGES:
            raise ValueError(f"unknown stage {until!r}; stages: {list(STAGES)}")
        from quantkit.serve.engine import offline_environment

        offline_environment(cache_dir=self.dir / "cache")
        _atomic_json(self.dir / "spec.json", vars(self.spec))
        stages = STAGES[: STAGES.index(until) + 1]
        work = [(s, label, recipe) for s in stages if s != "report" for label in self.spec.models
                for recipe in (self.spec.recipes if s not in ("checkpoint", "diagnose") else [None])
                if not (s == "degradation" and recipe == BASELINE)]
        for stage, label, recipe in (bar := tqdm(work, desc=f"study {self.spec.name}", unit="stage")):
            bar.set_postfix_str(f"{stage} {label} {recipe or ''}".strip())
            self._do(stage, label, recipe)
        if "report" in stages:
            self._do("report", None, None)
        return self.dir

    def _do(self, stage: str, label: str | None, recipe: str | None) -> None:
        try:
            getattr(self, f"_{stage}")(label, recipe)
        except Exception as err:
            where = "" if label is None else f" for model {label!r}" + ("" if recipe is None else f" recipe {recipe!r}")
            raise StageError(f"stage {stage!r} failed{where} ({self.dir}): {type(err).__name__}: {err}") from err

    # ------------------------------------------------------------------------------------ stages

    def _checkpoint(self, label: str, _: None) -> None:
        self.sources[label] = resolve_source(self.spec.models[label], self.spec)

    def _source(self, label: str) -> Path:
        if label not in self.sources:
            self._checkpoint(label, None)
        return self.sources[label]

    def _diagnose(self, label: str, _: None) -> None:
        out = self.dir / "diagnostics" / label
        if (out / "diagnostics.json").exists():
            return
        from quantkit.diagnose import diagnose, write_diagnostics
        from quantkit.quantize.recipe import load_recipe

        recipes = [r for r in self.spec.recipes
                   if (rec := load_recipe(r)).backend == "quantkit" and rec.scheme != "bf16" and rec.smoothquant is None]
        write_diagnostics(diagnose(self._source(label), recipes=recipes, progress=False, **self.spec.diagnose), out)

    def _quantize(self, label: str, recipe: str) -> None:
        out = self.checkpoint_dir(label, recipe)
        if (out / "config.json").exists():
            return
        from quantkit.quantize.checkpoint import quantize_checkpoint

        quantize_checkpoint(self._source(label), recipe, out)

    def _eval(self, label: str, recipe: str) -> None:
        out = self.eval_dir(label, recipe)
        if (out / "results.json").exists():
            return
        from quantkit.evals.suite import evaluate

        if out.exists():  # a run killed mid-eval: its partial samples are redone
            shutil.rmtree(out)
        e = self.spec.eval
        evaluate(self.checkpoint_dir(label, recipe), suite=e["suite"], backend=e["backend"], out_dir=out,
                 limit=e["limit"], allow_code=e["allow_code"], seed=e["seed"], dtype=e["dtype"], **self.spec.parallel)

    def _degradation(self, label: str, recipe: str) -> None:
        out = self.degradation_file(label, recipe)
        if out.exists():
            return
        _atomic_json(out, degradation(self, label, recipe))

    def _report(self, *_: None) -> None:
        results = study_results(self)
        _atomic_json(self.dir / "results.json", results)
        from quantkit.diagnose import figure_svgs
        from quantkit.report import render_report

        figures = {}
        for label in self.spec.models:
            path = self.dir / "diagnostics" / label / "diagnostics.json"
            if path.exists():
                figures.update({f"{label}: {name}": svg for name, svg in figure_svgs(json.loads(path.read_text())).items()})
        render_report(results, self.dir / "report", figures=figures)


def degradation(study: Study, label: str, recipe: str) -> dict[str, Any]:
    """Per benchmark: flip rate and paired-bootstrap delta (points) vs bf16; held-out KL of the checkpoint."""
    from quantkit.evals.degradation import answer_flips, heldout_kl, paired_bootstrap, read_samples

    base_dir, test_dir = study.eval_dir(label, BASELINE), study.eval_dir(label, recipe)
    base, test = read_samples(base_dir), read_samples(test_dir)
    benchmarks = json.loads((test_dir / "results.json").read_text())["benchmarks"]
    per_benchmark = {}
    for name, info in benchmarks.items():
        pairs = [(base[t][i]["score"], test[t][i]["score"]) for t in info["tasks"] for i in sorted(base.get(t, {})) if i in test.get(t, {})]
        if not pairs:
            continue
        delta = paired_bootstrap([a for a, _ in pairs], [b for _, b in pairs], seed=study.spec.eval["seed"])
        flips = [answer_flips(base[t], test[t]) for t in info["tasks"] if t in base and t in test]
        n = sum(f.n for f in flips)
        per_benchmark[name] = dict(
            delta_points=100 * delta.delta, ci95_points=[100 * delta.ci_low, 100 * delta.ci_high],
            noise_floor_points=100 * (delta.ci_high - delta.ci_low) / 2, p_not_worse=delta.p_not_worse, n=delta.n,
            flip_rate=sum(f.right_to_wrong + f.wrong_to_right for f in flips) / n if n else 0.0,
        )
    kl = heldout_kl(study.checkpoint_dir(label, BASELINE), study.checkpoint_dir(label, recipe), **study.spec.kl)
    return dict(model=label, recipe=recipe, benchmarks=per_benchmark, kl=kl)


def study_results(study: Study) -> dict[str, Any]:
    """The report's input (docs/report-format.md, schema_version 1) from the run directory."""
    rows, suite = [], None
    for label in study.spec.models:
        outliers = _outliers(study, label)
        for recipe in study.spec.recipes:
            ev = json.loads((study.eval_dir(label, recipe) / "results.json").read_text())
            suite = ev["suite"]
            scores = {b: 100 * v["score"] for b, v in ev["benchmarks"].items() if not math.isnan(v["score"])}
            row = dict(variant=label, model=study.spec.models[label], recipe=recipe, precision=_precision(recipe), scores=scores)
            if recipe != BASELINE:
                deg = json.loads(study.degradation_file(label, recipe).read_text())
                bench = deg["benchmarks"]
                row.update(noise_floor={b: v["noise_floor_points"] for b, v in bench.items() if b in scores},
                           flips={b: v["flip_rate"] for b, v in bench.items() if b in scores}, kl=deg["kl"]["mean"])
            if outliers:
                row["outliers"] = outliers
            rows.append(row)
    return dict(schema_version=1, study=study.spec.name, suite=suite["name"], suite_version=str(suite["version"]),
                created=_now(), rows=rows)


def _precision(recipe: str) -> str:
    from quantkit.quantize.recipe import load_recipe

    r = load_recipe(recipe)
    label = {"bf16": "BF16", "fp8_block": "W8A8", "nvfp4": "W4A4"}.get(r.scheme, r.name)
    return label + ("+SQ" if r.smoothquant else "") + (" (static)" if r.activation_scale == "static" else "")


OUTLIER_FIGURES = ("max_residual", "max_linear_input", "top_sink_ratio", "sink_rate_mean", "first_token_mass_mean",
                   "max_residual_kurtosis")


def _outliers(study: Study, label: str) -> dict[str, float] | None:
    """Headline diagnostics of the source checkpoint (quantkit.diagnose summary) for the report's outlier columns."""
    path = study.dir / "diagnostics" / label / "diagnostics.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())["summary"]
    return {k: summary[k] for k in OUTLIER_FIGURES if isinstance(summary.get(k), (int, float)) and math.isfinite(summary[k])}


def _now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
