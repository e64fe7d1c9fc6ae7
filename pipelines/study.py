"""A deployment study: models x recipes -> checkpoints -> vLLM + lm-eval -> degradation -> results.json -> report.

    quantkit run pipelines/default.yaml [--model MODEL] [--until STAGE]     (make quantize eval MODEL=...)
    quantkit run SPEC --executor ray [--address ADDR]   the same stages as Ray tasks (pipelines/executors.py)

Spec (YAML, see pipelines/default.yaml):

    name: default
    models: {ga: "zoo:ga", ...}      # label -> source: zoo:<preset> | model:<trained model> | local dir | hub id
    zoo: {size: tiny, dir: zoo}      # where zoo:<preset> checkpoints are built (cached)
    recipes: [bf16, w8a8_fp8_block, w4a4_nvfp4, w4a4_nvfp4_sq]   # bf16 is every model's baseline
    eval: {suite: mini, backend: vllm, limit: null, allow_code: false, seed: 1234, dtype: bfloat16}
                                     # + numerics: false | true (bf16) | [bf16, w4a4_nvfp4] (rows re-run in a
                                     # second summation order: their numerics floors), reference: false
                                     # + suites: {label: suite}: a model's own suite instead of `suite`
    kl: {num_sequences: 16, seq_len: 128, source: vllm, top_k: null}   # source: vllm (default with the vLLM
                                     # backend: the eval engines' prompt logprobs) | transformers (float32 reference);
                                     # top_k: null = full vocabulary, k = top-k lower bound (evals/degradation.py)
    diagnose: {num_sequences: 16, seq_len: 128}   # quantkit.diagnose on each source checkpoint
    quality: {num_sequences: 16, seq_len: 256}    # optional: the quality stage, each checkpoint's layer and block
                                     # SNRs vs its source on held-out text (where each row's noise sits; peers:
                                     # llm-compressor's NVFP4, blocks only)
    calibration: {num_sequences: 256, seq_len: 512, data: speeches+code, early_stop: 0.02}   # optional, each
                                     # key too: every recipe's calibration sets resized (recipes default to paper
                                     # 000's 4096 x 512 for SmoothQuant), their source (docs/calibration.md; default:
                                     # fits the model), SmoothQuant's early stop (null: every window)
    parallel: {tensor_parallel_size: 1, data_parallel_size: 1}   # vLLM TP; lm-eval DP (engine replicas)
    runs_dir: runs

Run directory runs/<name>[-<model label>]/. The stages and what marks each done are one table (STAGES);
every artifact is written atomically (quantkit.atomic: a temp dir or file beside it, renamed into place), so
its presence means "done" and a re-run skips it; a run killed mid-way (even by SIGKILL) loses only the stage
in flight, whose temp dir the next run removes. One `quantkit run` per run directory at a time (`.lock`;
a second one refuses with LockedError naming the holder's pid). The local executor runs the stages in this
process, in table order; `--executor ray` runs each model's model-scope stages, then each (model, recipe)
chain, as Ray tasks through the same `Study._do` (docs/scaling.md):

    spec.json                       the resolved spec
    diagnostics/<label>/            `quantkit diagnose` of the source checkpoint (JSON, summary, figures)
    checkpoints/<label>-<recipe>/   `quantkit quantize` output (bf16 too: the baseline checkpoint)
    evals/<label>-<recipe>/         `quantkit.evals.suite.evaluate` output (results.json, samples/, and with
                                    kl.source vllm heldout_logprobs.safetensors: the engine's held-out logprobs)
    degradation/<label>-<recipe>.json   flips, paired bootstrap (noise floor), held-out KL vs bf16
    quality/<label>-<recipe>.json   (with `quality`) `quantkit quality` : layer and block SNRs, per kind
    timings.json                    wall seconds and peak memory (GiB, `quantkit.peak_memory`: this process
                                    and its children) per (stage, model, recipe), merged over resumed runs: a
                                    stage found done keeps the figures of the run that made it (seconds 0 and no
                                    peak_gib if unknown), `cached`;
                                    each stage merges its entry under `.timings.lock` (Ray tasks write it too)
    results.json                    the report's input (docs/report-format.md; timings in meta.timings)
    report/                         Markdown, CSV, JSON, HTML (quantkit.report), with a "Time:" line

A failing stage raises StageError naming the stage, model and recipe.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol, cast

from tqdm import tqdm

from quantkit.atomic import atomic_dir, exclusive_lock, write_text_atomic
from quantkit.checkpoints import describe_architecture
from quantkit.errors import BAD_INPUT
from quantkit.evals.harness import BACKENDS, EvalBackend
from quantkit.formats.schemes import UNQUANTIZED
from quantkit.peak_memory import PeakMemory
from quantkit.quantize.recipe import Backend, Recipe, quality_reads
from quantkit.yamlfile import read_yaml

logger = logging.getLogger(__name__)

BASELINE = "bf16"
# The numerics stage's second summation order (quantkit.serve.cpu.linear): the default order's kernels on permuted
# input columns, about a BF16 row's cost (split-k, the order before 2026-11-29, computes decoding in float32: 3-4x).
NUMERICS_ORDER = "permute-k"
SPEC_KEYS = {
    "name",
    "models",
    "zoo",
    "recipes",
    "eval",
    "kl",
    "diagnose",
    "quality",
    "calibration",
    "parallel",
    "runs_dir",
}
QUALITY_DEFAULTS = dict(num_sequences=16, seq_len=256)  # `quantkit quality`'s held-out windows
EVAL_DEFAULTS = dict(
    suite="mini",
    suites=None,
    limits=None,  # {model label: items per task}: a model's own limit instead of `limit`
    backend=EvalBackend.VLLM,
    limit=None,
    allow_code=False,
    seed=1234,
    dtype="bfloat16",
    numerics=False,  # the numerics stage: true (the bf16 row) or a list of the spec's recipes, each row evaluated
    # again in NUMERICS_ORDER (its numerics floor); false: none
    reference=False,  # the reference stage: BF16 under the makers' prompt protocol (trained models that publish one)
)
KL_DEFAULTS = dict(num_sequences=16, seq_len=128, source=None, top_k=None)  # source None: vllm with the vllm backend


class KLSource(StrEnum):
    """Who computes the KL stage's logits (the study's `kl.source`; equal to its string)."""

    VLLM = "vllm"  # the served engine (quantkit's plugin): the numerics the evals see
    TRANSFORMERS = "transformers"  # the pure-torch fake-quant reference


KL_SOURCES = tuple(KLSource)


class StageError(RuntimeError):
    """A stage failed; the message names stage, model and recipe, the cause is chained. `bad_input`: the cause is
    bad input (quantkit.errors.BAD_INPUT; the CLI exits 2, else 1), kept where the chained cause is not: in the
    pickled copy a Ray task sends back to the driver."""

    def __init__(self, message: str, bad_input: bool = False) -> None:
        super().__init__(message)
        self.bad_input = bad_input


@dataclass
class StudySpec:
    name: str
    models: dict[str, str]
    recipes: list[str]
    zoo: dict[str, Any] = field(default_factory=lambda: dict(size="tiny", dir="zoo"))
    eval: dict[str, Any] = field(default_factory=lambda: dict(EVAL_DEFAULTS))
    kl: dict[str, Any] = field(default_factory=lambda: dict(KL_DEFAULTS, source=KLSource.VLLM))
    diagnose: dict[str, int] = field(default_factory=lambda: dict(num_sequences=16, seq_len=128))
    parallel: dict[str, int] = field(default_factory=lambda: dict(tensor_parallel_size=1, data_parallel_size=1))
    runs_dir: str = "runs"
    calibration: dict[str, int] | None = None  # {num_sequences, seq_len} for every recipe; None: the recipes' own
    quality: dict[str, int] | None = None  # {num_sequences, seq_len} of the quality stage; None: no quality stage


def load_spec(path: str | Path, model: str | None = None) -> StudySpec:
    """Read and validate a spec; `model` (hub id | local dir | zoo:<preset> | model:<name>) replaces its models."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"pipeline spec {path} does not exist")
    data = read_yaml(path)
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
        raise ValueError(
            f"{path}: recipes must include {BASELINE!r}, the baseline every degradation is measured against"
        )
    spec = StudySpec(**{k: v for k, v in data.items()})
    spec.parallel = {"tensor_parallel_size": 1, "data_parallel_size": 1, **(data.get("parallel") or {})}
    if unknown := sorted(set(spec.parallel) - {"tensor_parallel_size", "data_parallel_size"}):
        raise ValueError(f"{path}: unknown parallel key(s) {unknown}; known: tensor_parallel_size, data_parallel_size")
    if spec.calibration is not None:
        if not isinstance(spec.calibration, dict):
            raise ValueError(f"{path}: calibration must be a mapping (num_sequences and seq_len, data, early_stop)")
        from quantkit.quantize.provenance import apply_calibration

        try:  # bad settings fail here, before any work
            apply_calibration(load_recipe("w4a4_nvfp4_sq"), spec.calibration)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
    spec.quality = _quality_settings(path, data.get("quality"))
    spec.eval = {**EVAL_DEFAULTS, **(data.get("eval") or {})}
    if unknown := sorted(set(spec.eval) - set(EVAL_DEFAULTS)):
        raise ValueError(f"{path}: unknown eval key(s) {unknown}; known: {sorted(EVAL_DEFAULTS)}")
    _check_eval(path, spec.eval)
    spec.eval["suites"] = _model_suites(path, spec.eval["suites"], spec.models)
    spec.eval["limits"] = _model_limits(path, spec.eval["limits"], spec.models)
    if spec.eval["numerics"] and spec.eval["backend"] != EvalBackend.VLLM:
        raise ValueError(
            f"{path}: eval.numerics re-runs rows in vLLM's second CPU summation order: it needs eval.backend vllm"
        )
    if isinstance(spec.eval["numerics"], list) and (unknown := sorted(set(spec.eval["numerics"]) - set(spec.recipes))):
        raise ValueError(f"{path}: eval.numerics names {unknown}, not among the spec's recipes {spec.recipes}")
    if spec.eval["backend"] == EvalBackend.HF and (quantized := [r for r in spec.recipes if r != BASELINE]):
        raise ValueError(
            f"{path}: eval.backend hf (transformers) evaluates unquantized checkpoints only; recipes {quantized} "
            "need eval.backend vllm (quantkit's served numerics)"
        )
    spec.kl = {**KL_DEFAULTS, **(data.get("kl") or {})}
    if unknown := sorted(set(spec.kl) - set(KL_DEFAULTS)):
        raise ValueError(f"{path}: unknown kl key(s) {unknown}; known: {sorted(KL_DEFAULTS)}")
    spec.kl["source"] = spec.kl["source"] or (
        KLSource.VLLM if spec.eval["backend"] == EvalBackend.VLLM else KLSource.TRANSFORMERS
    )
    if spec.kl["source"] not in KL_SOURCES:
        raise ValueError(f"{path}: kl.source must be one of {[str(s) for s in KL_SOURCES]}, not {spec.kl['source']!r}")
    if spec.kl["source"] == KLSource.VLLM and (
        spec.eval["backend"] != EvalBackend.VLLM or spec.parallel["data_parallel_size"] != 1
    ):
        raise ValueError(
            f"{path}: kl.source vllm reads the eval engine's logprobs: it needs eval.backend vllm and "
            "parallel.data_parallel_size 1 (else set kl.source: transformers)"
        )
    top_k = spec.kl["top_k"]
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"{path}: kl.top_k must be null (full vocabulary) or a positive integer, not {top_k!r}")
    if model is not None:
        label = model.split(":", 1)[1] if model.startswith(("zoo:", "model:")) else Path(model.rstrip("/")).name
        suites = spec.eval["suites"]
        own = [suites[k] for k, source in spec.models.items() if source == model and k in suites]
        limits = spec.eval["limits"]
        own_limit = [limits[k] for k, source in spec.models.items() if source == model and k in limits]
        spec.models = {label: model}
        spec.name = f"{spec.name}-{label}"
        spec.eval["suites"] = {label: own[0]} if own else {}  # a model of the spec keeps its own suite
        spec.eval["limits"] = {label: own_limit[0]} if own_limit else {}  # and its own limit
    return spec


def _quality_settings(path: Path, value: Any) -> dict[str, int] | None:
    """The spec's `quality` key checked: absent or null, no quality stage; a mapping (`{}` for the defaults) of
    num_sequences and seq_len, positive integers. ValueError naming `quality.<key>`."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: quality must be a mapping of num_sequences and seq_len, not {value!r}")
    if unknown := sorted(set(value) - set(QUALITY_DEFAULTS)):
        raise ValueError(f"{path}: unknown quality key(s) {unknown}; known: {sorted(QUALITY_DEFAULTS)}")
    settings = {**QUALITY_DEFAULTS, **value}
    for key, n in settings.items():
        if type(n) is not int or n < 1:
            raise ValueError(f"{path}: quality.{key} must be a positive integer, not {n!r}")
    return settings


def _check_eval(path: Path, settings: dict[str, Any]) -> None:
    """The spec's eval settings checked before any work: the suite loads, the backend exists, limit and seed are
    integers (limit positive or null), the flags are booleans; ValueError naming `eval.<key>`."""
    from quantkit.evals.suite import load_suite

    if not isinstance(settings["suite"], str):
        raise ValueError(f"{path}: eval.suite must be a suite name or YAML path, not {settings['suite']!r}")
    try:
        load_suite(settings["suite"])
    except ValueError as err:
        raise ValueError(f"{path}: eval.suite: {err}") from None
    if settings["backend"] not in BACKENDS:  # quantkit.evals.harness
        raise ValueError(f"{path}: eval.backend must be one of {sorted(BACKENDS)}, not {settings['backend']!r}")
    limit, seed = settings["limit"], settings["seed"]
    if limit is not None and (type(limit) is not int or limit < 1):
        raise ValueError(f"{path}: eval.limit must be a positive integer or null, not {limit!r}")
    if type(seed) is not int:
        raise ValueError(f"{path}: eval.seed must be an integer, not {seed!r}")
    numerics = settings["numerics"]
    rows = isinstance(numerics, list) and all(isinstance(r, str) for r in numerics)
    if not isinstance(numerics, bool) and not rows:
        raise ValueError(f"{path}: eval.numerics must be true, false or a list of the spec's recipes, not {numerics!r}")
    for key in ("reference", "allow_code"):
        if not isinstance(settings[key], bool):
            raise ValueError(f"{path}: eval.{key} must be true or false, not {settings[key]!r}")


def _model_suites(path: Path, suites: Any, models: dict[str, str]) -> dict[str, str]:
    """eval.suites checked: a mapping of model label -> suite name or YAML path, each suite loadable."""
    from quantkit.evals.suite import load_suite

    if suites is None:
        return {}
    if not isinstance(suites, dict):
        raise ValueError(f"{path}: eval.suites must map model labels to suites, e.g. {{smollm: commonsense}}")
    if unknown := sorted(set(suites) - set(models)):
        raise ValueError(f"{path}: eval.suites names model(s) {unknown} that are not in models {sorted(models)}")
    for suite in suites.values():
        load_suite(suite)  # an unknown suite fails here, before any work
    return dict(suites)


def _model_limits(path: Path, limits: Any, models: dict[str, str]) -> dict[str, int | None]:
    """eval.limits checked: a mapping of model label -> items per task (a positive integer, or null for all)."""
    if limits is None:
        return {}
    if not isinstance(limits, dict) or set(limits) - set(models):
        raise ValueError(f"{path}: eval.limits must map model labels of {sorted(models)} to item counts")
    for label, n in limits.items():
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"{path}: eval.limits.{label} must be a positive integer or null, not {n!r}")
    return dict(limits)


def _atomic_json(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=1, default=str) + "\n")


def resolve_source(source: str, spec: StudySpec) -> Path:
    """zoo:<preset> -> built (or cached) zoo checkpoint; model:<name> -> the registry-shipped trained model, fetched
    into the cache on first use; a local directory -> itself; else a hub id -> download."""
    if source.startswith("zoo:"):
        from quantkit.models import zoo

        return zoo.build(source[4:], size=spec.zoo.get("size", "tiny"), zoo_dir=spec.zoo.get("dir", "zoo"))
    if source.startswith("model:"):
        from quantkit.models import trained

        return trained.fetch(source)
    path = Path(source)
    if path.exists():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a checkpoint directory (no config.json)")
        return path
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise FileNotFoundError(
            f"{source!r} is neither zoo:<preset>, model:<name> nor a local directory, and the "
            "hub is off (HF_HUB_OFFLINE=1): set HF_HUB_OFFLINE=0 with network access, or pass a local directory"
        )
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source))


class Study:
    """One run directory; `run()` does every missing stage for every (model, recipe), in order."""

    def __init__(self, spec: StudySpec, run_dir: str | Path | None = None) -> None:
        self.spec = spec
        self.dir = Path(run_dir) if run_dir is not None else Path(spec.runs_dir) / spec.name
        self.sources: dict[str, Path] = {}
        self.timings: dict[tuple[str, str, str], dict[str, Any]] = {}

    def artifact(self, stage: str, label: str | None = None, recipe: str | None = None) -> Path | None:
        """The file whose presence means `stage` is done for (label, recipe): the table's `artifact` in this run
        directory; None for a stage that always runs."""
        template = STAGE_BY_NAME[stage].artifact
        return None if template is None else self.dir / template.format(model=label, recipe=recipe)

    def _artifact_file(self, stage: str, label: str | None = None, recipe: str | None = None) -> Path:
        """`artifact` of a stage that has one (every stage but checkpoint and report)."""
        return cast(Path, self.artifact(stage, label, recipe))

    def checkpoint_dir(self, label: str, recipe: str) -> Path:
        """checkpoints/<label>-<recipe>/ of this run directory: the quantize stage's checkpoint (bf16 too)."""
        return self._artifact_file("quantize", label, recipe).parent

    def eval_dir(self, label: str, recipe: str) -> Path:
        """evals/<label>-<recipe>/ of this run directory: the eval stage's output (results.json, samples/)."""
        return self._artifact_file("eval", label, recipe).parent

    def numerics_dir(self, label: str, recipe: str = BASELINE) -> Path:
        """evals/<label>-<recipe>-numerics/: the row's checkpoint evaluated in the second summation order."""
        return self._artifact_file("numerics", label, recipe).parent

    def numerics_rows(self) -> list[str]:
        """The recipes whose rows the numerics stage re-evaluates: eval.numerics true -> [bf16], a list -> it."""
        numerics = self.spec.eval.get("numerics")
        return list(numerics) if isinstance(numerics, list) else [BASELINE] if numerics else []

    def reference_dir(self, label: str) -> Path:
        """evals/<label>-bf16-reference/: the BF16 checkpoint evaluated in its makers' prompt protocol."""
        return self._artifact_file("reference", label, BASELINE).parent

    def diagnostics_dir(self, label: str) -> Path:
        """diagnostics/<label>/ of this run directory: the diagnose stage's output for the source checkpoint."""
        return self._artifact_file("diagnose", label).parent

    def run(self, until: str = "report", executor: Executor | None = None) -> Path:
        """Run every stage up to `until` (inclusive); return the run directory.

        `executor`: None runs the stages here, one after the other in table order; a connected
        `quantkit.pipelines.executors.RayExecutor` runs them as Ray tasks. Holds the run directory's lock
        throughout: a second concurrent run raises LockedError at once. Locally the report is rendered at its first
        place in the order, at the end, and in between only where a stage ran since its last rendering (a resumed
        run's cached rows would render the same report again: 13-102 s each on SmolLM2's study of a dozen rows)."""
        if until not in STAGE_NAMES:
            raise ValueError(f"unknown stage {until!r}; stages: {list(STAGE_NAMES)}")
        with exclusive_lock(self.dir / ".lock", f"run directory {self.dir}"):
            from quantkit.serve.engine import offline_environment

            offline_environment(cache_dir=self.dir / "cache")
            _atomic_json(self.dir / "spec.json", vars(self.spec))
            self.timings = read_timings(self.dir)
            stages = STAGES[: STAGE_NAMES.index(until) + 1]
            if executor is not None:
                executor.run(self, stages)
                return self.dir
            work = self.work(stages)
            stale = True  # whether a stage ran since this run last rendered the report (it has not yet)
            for n, (stage, label, recipe) in enumerate(bar := tqdm(work, desc=f"study {self.spec.name}", unit="stage")):
                if stage.scope == "study" and not stale and n < len(work) - 1:
                    continue  # nothing new since the last rendering: a resumed run re-renders only what changed
                bar.set_postfix_str(f"{_where(stage.name, label, recipe)}; {self.left(work[n:])}")
                ran = self._do(stage, label, recipe)
                stale = stage.scope != "study" and (stale or ran)
        return self.dir

    def work(self, stages: Sequence[Stage]) -> list[tuple[Stage, str | None, str | None]]:
        """The local executor's order, so that every row appears as soon as it is measured: per model its
        checkpoint, then per recipe (bf16 first) the chain quantize -> eval -> degradation followed by the
        report (re-rendered with the rows so far); the model's diagnostics right after its bf16 row."""
        model_scope = [s for s in stages if s.scope == "model"]
        chain = [s for s in stages if s.scope in ("recipe", "asked", "quantized")]
        report = [(s, None, None) for s in stages if s.scope == "study"]
        recipes = [BASELINE, *(r for r in self.spec.recipes if r != BASELINE)]
        out: list[tuple[Stage, str | None, str | None]] = []
        for label in self.spec.models:
            out += [(s, label, None) for s in model_scope if s.name == "checkpoint"]
            for recipe in recipes:
                out += [
                    (s, label, recipe)
                    for s in chain
                    if s.scope == "recipe"
                    or (s.scope == "asked" and self.runs(s.name, label, recipe))
                    or (s.scope == "quantized" and recipe != BASELINE and self.runs(s.name, label, recipe))
                ]
                if recipe == BASELINE:
                    out += [(s, label, None) for s in model_scope if s.name != "checkpoint"]
                out += report
        return out

    def left(self, work: Sequence[tuple[Stage, str | None, str | None]]) -> str:
        """What is left of `work` (its stages counted by name) and how long it should take: each stage's mean
        measured seconds in this run directory (timings.json: this and earlier runs), "?" where none is known."""
        measured: dict[str, list[float]] = {}
        for (name, _, _), t in self.timings.items():
            if _measured(t):
                measured.setdefault(name, []).append(t["seconds"])
        todo = [
            (stage.name, label, recipe)
            for stage, label, recipe in work
            if (done := self.artifact(stage.name, label, recipe)) is None or not done.exists()
        ]
        counts: dict[str, int] = {}
        for name, _, _ in todo:
            counts[name] = counts.get(name, 0) + 1
        unknown = any(name not in measured for name in counts)
        seconds = sum(sum(measured[name]) / len(measured[name]) for name, _, _ in todo if name in measured)
        eta = f"~{seconds / 60:.0f} min" + (" + stages not yet timed" if unknown else "")
        return "left: " + ", ".join(f"{n} {name}" for name, n in counts.items()) + f" ({eta})" if todo else "left: none"

    def runs(self, stage: str, label: str, recipe: str = BASELINE) -> bool:
        """Whether a stage the spec may leave out runs for model `label` (and `recipe`): numerics for the rows
        eval.numerics names (`numerics_rows`); reference with eval.reference on the bf16 row of a trained model whose
        makers publish a score with a prompt protocol quantkit runs; quality with the spec's `quality`, for a recipe
        quantkit quantizes or a peer's `quantkit quality` reads (`recipe.quality_reads`)."""
        if stage == "numerics":
            return recipe in self.numerics_rows()
        if stage == "reference":
            return recipe == BASELINE and bool(self.spec.eval.get("reference")) and self.reference(label) is not None
        if stage == "quality":
            return self.spec.quality is not None and quality_reads(self.recipe(recipe))
        return True

    def reference(self, label: str) -> Any:
        """The published score (`trained.PublishedScore`) of model `label` whose protocol quantkit runs, else None."""
        published = _published(self, label)
        return published if published is not None and published.suite is not None else None

    def expected(self, stage: str) -> str:
        """ ", expect ~N min (mean of k earlier <stage> stages here)" from this run directory's measured timings of
        the same stage (an eval row predicts the next eval row), or "" when none is known."""
        seconds = [t["seconds"] for (name, _, _), t in self.timings.items() if name == stage and _measured(t)]
        if not seconds:
            return ""
        mean = sum(seconds) / len(seconds)
        return f", expect ~{mean / 60:.1f} min (mean of {len(seconds)} earlier {stage} stage{'s' * (len(seconds) > 1)})"

    def targets(self, stage: Stage) -> list[tuple[str | None, str | None]]:
        """(model label, recipe) pairs the stage runs for, by its scope (SCOPES); None where the stage is not
        per model / recipe."""
        if stage.scope == "study":
            return [(None, None)]
        if stage.scope == "model":
            return [(label, None) for label in self.spec.models]
        if stage.scope == "asked":
            return [
                (label, recipe)
                for label in self.spec.models
                for recipe in self.spec.recipes
                if self.runs(stage.name, label, recipe)
            ]
        if stage.scope == "recipe":
            return [(label, recipe) for label in self.spec.models for recipe in self.spec.recipes]
        return [
            (label, recipe)
            for label in self.spec.models
            for recipe in self.spec.recipes
            if recipe != BASELINE and self.runs(stage.name, label, recipe)
        ]

    def _do(self, stage: Stage, label: str | None, recipe: str | None) -> bool:
        """Run one stage unless its artifact exists; record and log its wall time. Whether it ran (False: cached)."""
        key = (stage.name, label or "", recipe or "")
        done = self.artifact(stage.name, label, recipe)
        if done is not None and done.exists():
            self._check_cached_eval(stage.name, label, done)
            self._record_timing(key, None)
            tqdm.write(f"stage {_where(stage.name, label, recipe)}: cached", file=sys.stderr)
            return False
        tqdm.write(f"stage {_where(stage.name, label, recipe)}: started{self.expected(stage.name)}", file=sys.stderr)
        start = time.perf_counter()
        try:
            with PeakMemory() as peak:
                stage.run(self, label, recipe)
        except Exception as err:
            raise StageError(
                f"stage {stage.name!r} failed{describe_target(label, recipe)} ({self.dir}): "
                f"{type(err).__name__}: {err}",
                bad_input=isinstance(err, BAD_INPUT),
            ) from err
        seconds = time.perf_counter() - start
        self._record_timing(key, {"seconds": round(seconds, 2), "cached": False, "peak_gib": round(peak.gib, 2)})
        tqdm.write(
            f"stage {_where(stage.name, label, recipe)}: {seconds:.1f} s, peak memory {peak.gib:.2f} GiB",
            file=sys.stderr,
        )
        return True

    def _record_timing(self, key: tuple[str, str, str], timing: dict[str, Any] | None) -> None:
        """Merge one entry (None: found done, keeping the figures on file) into timings.json, under a lock: the
        stages of a Ray study write it from several processes. `self.timings` becomes the merged table."""
        with exclusive_lock(self.dir / ".timings.lock", f"timings of {self.dir}", wait=True):
            timings = read_timings(self.dir)
            timings[key] = timing or {**timings.get(key, {"seconds": 0.0}), "cached": True}
            write_timings(self.dir, timings)
        self.timings = timings

    # ------------------------------------------------------------------------------------ stages

    def _checkpoint(self, label: str, _: None) -> None:
        self.sources[label] = resolve_source(self.spec.models[label], self.spec)

    def _source(self, label: str) -> Path:
        if label not in self.sources:
            self._checkpoint(label, None)
        return self.sources[label]

    def _diagnose(self, label: str, _: None) -> None:
        from quantkit.diagnose.run import diagnose, why_not_diagnosable, write_diagnostics
        from quantkit.quantize.recipe import load_recipe

        # quantkit's own schemes rounded to nearest: the study's other recipes are left out, not refused
        recipes = [r for r in self.spec.recipes if why_not_diagnosable(load_recipe(r)) is None]
        result = diagnose(self._source(label), recipes=recipes, progress=False, **self.spec.diagnose)
        with atomic_dir(self.diagnostics_dir(label), overwrite=True) as tmp:
            write_diagnostics(result, tmp)

    def suite(self, label: str) -> str:
        """The eval suite of model `label`: its own from eval.suites, else eval.suite."""
        return (self.spec.eval.get("suites") or {}).get(label, self.spec.eval["suite"])

    def recipe(self, name: str) -> Recipe:
        """The recipe `name` as this study applies it: the spec's `calibration` settings applied."""
        from quantkit.quantize.provenance import apply_calibration
        from quantkit.quantize.recipe import load_recipe

        recipe = load_recipe(name)
        return apply_calibration(recipe, self.spec.calibration) if self.spec.calibration else recipe

    def _quantize(self, label: str, recipe: str) -> None:
        from quantkit.diagnose.budget import resolve_bit_budget
        from quantkit.quantize.checkpoint import quantize_checkpoint

        quantize_checkpoint(
            self._source(label),
            resolve_bit_budget(self._source(label), self.recipe(recipe), progress=False),
            self.checkpoint_dir(label, recipe),
            overwrite=True,
            statistics_cache=self.dir / "cache" / "smoothquant",  # the model's SQ rows share their statistics
        )

    def _eval(self, label: str, recipe: str) -> None:
        kl = self.spec.kl
        heldout = (
            dict(num_sequences=kl["num_sequences"], seq_len=kl["seq_len"], top_k=kl["top_k"])
            if kl["source"] == KLSource.VLLM
            else None
        )  # the KL's logprobs, from this same engine
        self._evaluate(
            label, self.checkpoint_dir(label, recipe), self.eval_dir(label, recipe), self.suite(label), heldout
        )

    def _numerics(self, label: str, recipe: str) -> None:
        """The row's checkpoint and suite again, every half-precision and emulated quantized Linear summed in the
        second order (NUMERICS_ORDER, `quantkit.serve.cpu.linear`): its answer flips against the eval stage's run of
        the same row are that row's numerics floor."""
        from quantkit.serve.engine import SUMMATION_ENV

        self._checkpoint_ready(label, recipe)
        saved = os.environ.get(SUMMATION_ENV)
        os.environ[SUMMATION_ENV] = NUMERICS_ORDER  # read by the engine's layers as they load (here and spawned)
        try:
            self._evaluate(
                label, self.checkpoint_dir(label, recipe), self.numerics_dir(label, recipe), self.suite(label), None
            )
        finally:
            if saved is None:
                os.environ.pop(SUMMATION_ENV, None)
            else:
                os.environ[SUMMATION_ENV] = saved

    def _reference(self, label: str, recipe: str) -> None:
        """The BF16 checkpoint under its makers' prompt protocol (`reference(label).suite`): how much of the gap to
        the published score is prompt format."""
        self._checkpoint_ready(label, recipe)
        self._evaluate(
            label, self.checkpoint_dir(label, recipe), self.reference_dir(label), self.reference(label).suite, None
        )

    def evaluated_suite(self, stage: str, label: str | None) -> str | None:
        """The suite an evaluating stage (eval, numerics, reference) runs for model `label`; None for other stages."""
        if label is None:
            return None
        if stage in ("eval", "numerics"):
            return self.suite(label)
        reference = self.reference(label) if stage == "reference" else None
        return None if reference is None else reference.suite

    def _check_cached_eval(self, stage: str, label: str | None, artifact: Path) -> None:
        """A found evaluation must be of the suite (name and version) and items per task this spec runs: a changed
        suite is never mixed into one report with the old one. StageError (bad input) naming both otherwise."""
        from quantkit.evals.suite import load_suite

        name = self.evaluated_suite(stage, label)
        if name is None or label is None:
            return
        suite = load_suite(name)
        limit = self.limit(label)
        want = dict(name=suite.name, version=suite.version, limit=suite.limit if limit is None else limit)
        evaluation = json.loads(artifact.read_text())
        record = evaluation.get("suite") or {}
        found = {k: record.get(k) for k in want}
        if found != want:
            raise StageError(
                f"{artifact} was evaluated on suite {found['name']} v{found['version']} (limit {found['limit']}); "
                f"this spec runs {want['name']} v{want['version']} (limit {want['limit']}): move that directory "
                "aside to evaluate it again, or use another --run-dir",
                bad_input=True,
            )
        if self.spec.eval["backend"] != EvalBackend.VLLM:
            return
        from quantkit.serve.engine import GEMM_ENV, SWITCH_ENV, cpu_kernels

        kernels = evaluation.get("cpu_kernels") or cpu_kernels(amd_preference=False)  # none recorded: before 2026-12-02
        if kernels != cpu_kernels():
            raise StageError(
                f"{artifact} was computed with CPU kernels {kernels}; this process uses {cpu_kernels()}: another "
                "summation order, not mixed into one report. Use another --run-dir, or set "
                f"{SWITCH_ENV}=on / off and {GEMM_ENV}=torch / onednn to compute as that evaluation did",
                bad_input=True,
            )

    def limit(self, label: str) -> int | None:
        """Items per task for model `label`: its own from eval.limits, else eval.limit (None: the suite's)."""
        limits = self.spec.eval.get("limits") or {}
        return limits[label] if label in limits else self.spec.eval["limit"]

    def _checkpoint_ready(self, label: str, recipe: str) -> None:
        """Make the (label, recipe) checkpoint if it is missing (an asked-scope stage run on its own); a present
        one is left alone, its timing entry too."""
        if not self._artifact_file("quantize", label, recipe).exists():
            self._do(STAGE_BY_NAME["quantize"], label, recipe)

    def _evaluate(self, label: str, checkpoint: Path, out: Path, suite: str, heldout: dict[str, Any] | None) -> None:
        """`evaluate` of model `label`'s `checkpoint` with this study's eval settings into `out`, atomically."""
        from quantkit.evals.suite import evaluate

        e = self.spec.eval
        if e["backend"] == EvalBackend.VLLM:  # a checkpoint vLLM would refuse fails here, before any engine or temp dir
            from quantkit.serve.checkpoint_check import check_servable

            check_servable(checkpoint)
        with atomic_dir(out, overwrite=True) as tmp:  # a killed eval leaves only a temp dir, never a half `out`
            results = evaluate(
                checkpoint,
                suite=suite,
                backend=e["backend"],
                out_dir=tmp,
                limit=self.limit(label),
                allow_code=e["allow_code"],
                seed=e["seed"],
                dtype=e["dtype"],
                heldout_logprobs=heldout,
                **self.spec.parallel,
            )
            kernels = {}  # which kernels summed it: a cached row must match them (_check_cached_eval)
            if e["backend"] == EvalBackend.VLLM:
                from quantkit.serve.engine import cpu_kernels

                kernels = {"cpu_kernels": cpu_kernels()}
            out_dir = str(out.resolve())  # not the temp dir
            _atomic_json(tmp / "results.json", {**results, **kernels, "out_dir": out_dir})
        if (
            e["backend"] == EvalBackend.VLLM
        ):  # the next row's engine opens in this process: free this one's memory first
            from quantkit.serve.engine import release_engine_memory

            release_engine_memory()

    def _degradation(self, label: str, recipe: str) -> None:
        _atomic_json(self._artifact_file("degradation", label, recipe), degradation(self, label, recipe))

    def _quality(self, label: str, recipe: str) -> None:
        """`quantkit quality` of the (label, recipe) checkpoint against its source on the spec's held-out windows:
        each quantized layer's output SNR, per projection kind (`sensitivity`), and the fake-quant reference's KL."""
        from transformers import AutoTokenizer

        from quantkit.data import heldout_windows
        from quantkit.quantize.quality import quality

        settings = cast(dict[str, int], self.spec.quality)
        source = self._source(label)
        tokens = heldout_windows(AutoTokenizer.from_pretrained(source), settings["num_sequences"], settings["seq_len"])
        result = quality(source, self.checkpoint_dir(label, recipe), tokens)
        _atomic_json(self._artifact_file("quality", label, recipe), {**result, **settings})

    def _report(self, *_: None) -> None:
        results = study_results(self)
        _atomic_json(self.dir / "results.json", results)
        from quantkit.diagnose.plots import figure_svgs
        from quantkit.report.render import render_report

        figures = {}
        for label in self.spec.models:
            path = self._artifact_file("diagnose", label)
            if path.exists():
                figures.update(
                    {f"{label}: {name}": svg for name, svg in figure_svgs(json.loads(path.read_text())).items()}
                )
        render_report(results, self.dir / "report", figures=figures)


SCOPES = {  # scope -> the (model, recipe) targets a stage runs for (Study.targets)
    "model": "per model",
    "recipe": "per model x recipe",
    "asked": "per model x recipe where the spec asks (numerics: eval.numerics's rows; reference: bf16)",
    "quantized": "per model x recipe, bf16 excepted (quality: where the spec asks)",
    "study": "once",
}


@dataclass(frozen=True)
class Stage:
    """One row of the stage table. `scope`: a key of SCOPES. `artifact`: the path in the run directory, with
    {model} and {recipe} filled in, whose presence means the stage is done for that target (None: the stage
    always runs); `run(study, model, recipe)` makes it, atomically."""

    name: str
    scope: str
    artifact: str | None
    # run(study, model, recipe): each argument is a str or None as `scope` says (a model stage gets recipe None)
    run: Callable[[Study, Any, Any], None]

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"stage {self.name!r}: unknown scope {self.scope!r}; scopes: {list(SCOPES)}")


STAGES = (  # in order; `quantkit run --until` and the Makefile's study targets name these stages
    Stage("checkpoint", "model", None, Study._checkpoint),  # a zoo build is cached in the zoo
    Stage("diagnose", "model", "diagnostics/{model}/diagnostics.json", Study._diagnose),
    Stage("quantize", "recipe", "checkpoints/{model}-{recipe}/config.json", Study._quantize),
    Stage("eval", "recipe", "evals/{model}-{recipe}/results.json", Study._eval),  # checks servability first
    Stage("numerics", "asked", "evals/{model}-{recipe}-numerics/results.json", Study._numerics),
    Stage("reference", "asked", "evals/{model}-{recipe}-reference/results.json", Study._reference),
    Stage("degradation", "quantized", "degradation/{model}-{recipe}.json", Study._degradation),
    Stage("quality", "quantized", "quality/{model}-{recipe}.json", Study._quality),  # where the spec asks
    Stage("report", "study", None, Study._report),  # re-rendered on every run
)
STAGE_NAMES = tuple(stage.name for stage in STAGES)
STAGE_BY_NAME = {stage.name: stage for stage in STAGES}


class Executor(Protocol):
    """Runs `stages` (a prefix of STAGES) for every target of `study`, each through `study._do`, while
    `Study.run` holds the run directory's lock; raises StageError for a failed stage."""

    def run(self, study: Study, stages: Sequence[Stage]) -> None:
        """Each of `stages` for every target of `study` (model, recipe or study scope), through `study._do`;
        StageError for a failed stage."""
        ...


def stages_help() -> str:
    """One line for `quantkit run --until`: every stage in order with its scope."""
    return ", ".join(f"{stage.name} ({SCOPES[stage.scope]})" for stage in STAGES)


def _where(stage: str, label: str | None, recipe: str | None) -> str:
    return " ".join(x for x in (stage, label, recipe) if x)


def describe_target(label: str | None, recipe: str | None) -> str:
    """ " for model 'ga' recipe 'w4a4_nvfp4'" (empty for a study-scope target): the target in a StageError."""
    return "" if label is None else f" for model {label!r}" + ("" if recipe is None else f" recipe {recipe!r}")


def _measured(timing: dict[str, Any]) -> bool:
    """Whether a timings entry holds a measured time: one this run made, or one a resumed run found done and kept
    from the run that made it (cached with seconds > 0; 0: unknown)."""
    return not timing["cached"] or timing["seconds"] > 0


def read_timings(run_dir: Path) -> dict[tuple[str, str, str], dict[str, Any]]:
    """timings.json of a run directory as {(stage, model, recipe): {seconds, cached[, peak_gib]}} ({} when absent;
    peak_gib is missing from entries written before it was measured)."""
    path = run_dir / "timings.json"
    entries = json.loads(path.read_text())["entries"] if path.exists() else []
    return {
        (e["stage"], e["model"], e["recipe"]): {k: e[k] for k in ("seconds", "cached", "peak_gib") if k in e}
        for e in entries
    }


def write_timings(run_dir: Path, timings: dict[tuple[str, str, str], dict[str, Any]]) -> None:
    """timings.json, entries in table order of their stage (Ray tasks finish in any order), else as given."""
    order = {name: i for i, name in enumerate(STAGE_NAMES)}
    ordered = dict(sorted(timings.items(), key=lambda item: order.get(item[0][0], len(order))))
    _atomic_json(run_dir / "timings.json", {"entries": _timing_entries(ordered)})


def _timing_entries(timings: dict[tuple[str, str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    return [dict(stage=stage, model=model, recipe=recipe, **t) for (stage, model, recipe), t in timings.items()]


def degradation(study: Study, label: str, recipe: str) -> dict[str, Any]:
    """Per benchmark (its tasks pooled): flip rate and paired-bootstrap delta (points) vs bf16, from
    `quantkit.evals.degradation.compare_samples`; held-out KL vs bf16: with kl.source vllm from the two eval
    engines' recorded logprobs (`engine_kl`), else the float32 transformers reference (`heldout_kl`)."""
    from quantkit.evals.degradation import HeldoutLogprobsError, compare_samples, engine_kl, heldout_kl, read_samples

    base_dir, test_dir = study.eval_dir(label, BASELINE), study.eval_dir(label, recipe)
    benchmarks = json.loads(study._artifact_file("eval", label, recipe).read_text())["benchmarks"]
    groups = {name: info["tasks"] for name, info in benchmarks.items()}
    compared = compare_samples(read_samples(base_dir), read_samples(test_dir), groups, seed=study.spec.eval["seed"])
    per_benchmark = {
        name: dict(
            delta_points=100 * delta.delta,
            ci95_points=[100 * delta.ci_low, 100 * delta.ci_high],
            noise_floor_points=100 * (delta.ci_high - delta.ci_low) / 2,
            p_not_worse=delta.p_not_worse,
            n=delta.n,
            flip_rate=flips.flip_rate,
        )
        for name, (flips, delta) in compared.items()
    }
    if study.spec.kl["source"] == KLSource.VLLM:
        kl = engine_kl(base_dir, test_dir)
        settings = study.spec.kl
        if (kl["tokens"], kl["mode"], kl.get("top_k")) != (
            settings["num_sequences"] * settings["seq_len"],
            "full" if settings["top_k"] is None else "topk",
            settings["top_k"],
        ):
            raise HeldoutLogprobsError(
                f"{test_dir} recorded held-out logprobs under other kl settings than the spec's "
                f"{settings}: remove the model's evals/ directories to re-run them"
            )
    else:
        kl = dict(
            heldout_kl(
                study.checkpoint_dir(label, BASELINE),
                study.checkpoint_dir(label, recipe),
                num_sequences=study.spec.kl["num_sequences"],
                seq_len=study.spec.kl["seq_len"],
            ),
            source=KLSource.TRANSFORMERS,
            mode="full",
        )
    return dict(model=label, recipe=recipe, benchmarks=per_benchmark, kl=kl)


def study_results(study: Study) -> dict[str, Any]:
    """The report's input (docs/report-format.md, schema_version 1) from the run directory: a row for every
    (model, recipe) measured so far, the rest named in meta.pending; ValueError when no row is measured."""
    from quantkit.checkpoints import checkpoint_size
    from quantkit.quantize.provenance import checkpoint_calibration

    rows, suites, pending = [], {}, []
    for label in study.spec.models:
        outliers = _outliers(study, label)
        for recipe in study.spec.recipes:
            measured = [study._artifact_file("eval", label, recipe)]
            measured += [study._artifact_file("degradation", label, recipe)] if recipe != BASELINE else []
            # the row's size, calibration and section read its checkpoint and the bf16 one: a checkpoint deleted
            # (to save disk) while its eval was kept is pending until its quantize stage re-creates it
            measured += [study._artifact_file("quantize", label, r) for r in dict.fromkeys((BASELINE, recipe))]
            if not all(path.exists() for path in measured):  # not measured yet: the report says so
                pending.append(f"{label} {recipe}")
                continue
            section = describe_architecture(
                json.loads((study.checkpoint_dir(label, BASELINE) / "config.json").read_text())
            )
            ev = json.loads(study._artifact_file("eval", label, recipe).read_text())
            suites[ev["suite"]["name"]] = str(ev["suite"]["version"])
            scores = {b: 100 * v["score"] for b, v in ev["benchmarks"].items() if not math.isnan(v["score"])}
            row = dict(
                variant=label,
                model=study.spec.models[label],
                section=section,
                recipe=recipe,
                precision=_precision(recipe),
                scores=scores,
                calibration=checkpoint_calibration(study.recipe(recipe), study.checkpoint_dir(label, recipe)),
                size=checkpoint_size(study.checkpoint_dir(label, recipe), study.checkpoint_dir(label, BASELINE)),
            )
            if recipe != BASELINE:
                deg = json.loads(study._artifact_file("degradation", label, recipe).read_text())
                bench = deg["benchmarks"]
                row.update(
                    noise_floor={b: v["noise_floor_points"] for b, v in bench.items() if b in scores},
                    flips={b: v["flip_rate"] for b, v in bench.items() if b in scores},
                    kl=deg["kl"]["mean"],
                )
            figures = {**(outliers or {}), **_smoothed_inputs(study.checkpoint_dir(label, recipe))}
            if figures:
                row["outliers"] = figures
            rows.append(row)
    if not rows:
        raise ValueError(f"no row of study {study.spec.name!r} is measured yet (pending: {', '.join(pending)})")
    verdicts = study_verdicts(study, [(str(r["variant"]), str(r["recipe"])) for r in rows])
    return dict(
        schema_version=1,
        study=study.spec.name,
        suite="+".join(suites),  # the models' suites, in order of first use ("code+commonsense")
        suite_version="+".join(suites.values()),
        created=_now(),
        rows=rows,
        meta=dict(
            timings=timing_summary(study.timings),
            pending=pending,
            sensitivity=_sensitivity(study),
            checkpoint_sensitivity=_checkpoint_sensitivity(study, "sensitivity"),
            checkpoint_block_sensitivity=_checkpoint_sensitivity(study, "block_sensitivity"),
            verdicts=verdicts,
        ),
    )


def method_baseline(recipe: str, recipes: Sequence[str]) -> str | None:
    """The recipe a method row is judged against: the first round-to-nearest recipe of `recipes` with the same
    weight format (`Scheme.weight_grid`: plain W4A4 for W4A4+SQ, W4A4/W8A8 mixed, Four Over Six, and for a
    peer's NVFP4 rows, whose preset takes the same weight format: `PEER_FORMATS`); None for bf16, a plain recipe
    itself, a peer preset without a quantkit format, or a study without the plain one."""
    from quantkit.formats.schemes import SCHEMES
    from quantkit.quantize.recipe import PEER_FORMATS, load_recipe

    rec = load_recipe(recipe)
    if rec.scheme == UNQUANTIZED or rec.round_to_nearest:
        return None
    scheme = rec.scheme if rec.backend == Backend.QUANTKIT else PEER_FORMATS.get(rec.scheme)
    if scheme is None:
        return None
    grid = SCHEMES[scheme].weight_grid

    def is_plain(r: str) -> bool:
        rec = load_recipe(r)
        return rec.round_to_nearest and SCHEMES[rec.scheme].weight_grid == grid

    return next((r for r in recipes if is_plain(r)), None)


HISTORY_FILE = "history.json"  # per measured row: [{avg, date, host, suite}, ...], one entry per evaluation read


def study_verdicts(study: Study, measured: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """meta.verdicts of results.json (`quantkit.evals.verdicts` says what each figure is and the rule): per model
    the numerics floors (BF16's, and each quantized row's that eval.numerics names), each measured quantized row
    against BF16 and each method row against its plain baseline (each family Holm-corrected, each delta held to the
    larger of its two rows' floors), the published reference and its protocol's measured effect, and rows whose Avg
    moved since the last report of this run directory (HISTORY_FILE, updated here)."""
    from quantkit.evals import verdicts as v
    from quantkit.evals.suite import load_suite

    seed = study.spec.eval["seed"]
    done = set(measured)
    out: dict[str, Any] = dict(rule=v.RULE, alpha=v.ALPHA, models={})
    current: dict[str, dict[str, Any]] = {}
    floors: dict[str, float | None] = {}  # "<model> <recipe>" -> the numerics floor its verdicts use (row_floor)
    for label in study.spec.models:
        if (label, BASELINE) not in done:
            continue
        base_dir = study.eval_dir(label, BASELINE)
        suite = load_suite(study.suite(label))
        in_avg = suite.avg or list(suite.benchmarks)
        quantized = [r for r in study.spec.recipes if r != BASELINE and (label, r) in done]
        row_numerics: dict[str, dict[str, Any]] = {}  # recipe -> its row against itself in the second order
        for r in [BASELINE, *quantized]:
            if study._artifact_file("numerics", label, r).exists():
                row_numerics[r] = v.compare_runs(study.eval_dir(label, r), study.numerics_dir(label, r), in_avg, seed)
                host = json.loads(study._artifact_file("numerics", label, r).read_text()).get("host") or {}
                row_numerics[r]["order"] = host.get("summation")  # None in records older than the host record
        measured_floors = {r: cast(float, v.numerics_floor(c)) for r, c in row_numerics.items()}
        numerics = row_numerics.pop(BASELINE, None)
        floor = measured_floors.get(BASELINE)
        for r in [BASELINE, *quantized]:
            floors[f"{label} {r}"] = v.row_floor(measured_floors, r, BASELINE)
        vs_bf16 = v.judge(
            {r: v.compare_runs(base_dir, study.eval_dir(label, r), in_avg, seed) for r in quantized},
            {r: v.pair_floor(measured_floors, BASELINE, r, BASELINE) for r in quantized},
        )
        families: dict[str, dict[str, Any]] = {}
        for r in quantized:
            base = method_baseline(r, study.spec.recipes)
            if base is not None and (label, base) in done:
                families.setdefault(base, {})[r] = v.compare_runs(
                    study.eval_dir(label, base), study.eval_dir(label, r), in_avg, seed
                )
        entry: dict[str, Any] = dict(
            numerics=numerics,
            numerics_floor=floor,
            row_numerics=row_numerics,
            vs_bf16=vs_bf16,
            vs_baseline={
                base: v.judge(family, {r: v.pair_floor(measured_floors, base, r, BASELINE) for r in family})
                for base, family in families.items()
            },
        )
        published = _published(study, label)
        if published is not None:
            bf16 = json.loads(study._artifact_file("eval", label, BASELINE).read_text())["benchmarks"]
            ours = bf16.get(published.benchmark, {}).get("score")
            prompt = None
            if study._artifact_file("reference", label, BASELINE).exists():
                effect = v.compare_runs(base_dir, study.reference_dir(label), [published.benchmark], seed)
                prompt = v.judge({"prompt": effect}, floor)["prompt"]
            entry["reference"] = v.reference_sentence(
                label, published, None if ours is None else 100 * ours, prompt, floor
            )
        out["models"][label] = entry
        for r in [BASELINE, *quantized]:
            ev = json.loads(study._artifact_file("eval", label, r).read_text())
            scores = [100 * ev["benchmarks"][b]["score"] for b in in_avg if b in ev["benchmarks"]]
            current[f"{label} {r}"] = dict(
                avg=sum(scores) / len(scores),
                date=ev.get("date"),
                host=ev.get("host"),
                suite=f"{ev['suite']['name']} v{ev['suite']['version']}",
            )
    history_path = study.dir / HISTORY_FILE
    history = json.loads(history_path.read_text()) if history_path.exists() else {}
    for key, now in current.items():
        runs = history.setdefault(key, [])
        if not runs or runs[-1].get("date") != now["date"]:
            runs.append(now)
    for moved in v.moved_rows({k: history[k] for k in current}, floors):
        out["models"][moved["row"].split(" ", 1)[0]].setdefault("moved", []).append(moved)
    _atomic_json(history_path, history)
    names = {r: _precision(r) for r in study.spec.recipes}
    out["sentences"] = [line for label, e in out["models"].items() for line in v.model_sentences(label, e, names)]
    return out


def _published(study: Study, label: str) -> Any:
    """The makers' published score of a trained-model source (`trained.PublishedScore`), else None."""
    from quantkit.models import trained

    source = study.spec.models[label]
    return trained.lookup(source).reference if source.startswith(trained.SOURCE_PREFIX) else None


def timing_summary(timings: dict[tuple[str, str, str], dict[str, Any]]) -> dict[str, Any]:
    """Wall seconds per stage and in total, the largest peak memory per stage (GiB, over the entries that have
    one: stages measured before it was recorded have none) and the per (stage, model, recipe) entries; the report
    stage, in flight while results.json is written, is left out."""
    entries = [e for e in _timing_entries(timings) if e["stage"] != "report"]
    stages: dict[str, float] = {}
    peak_gib: dict[str, float] = {}
    for e in entries:
        stages[e["stage"]] = round(stages.get(e["stage"], 0.0) + e["seconds"], 2)
        if "peak_gib" in e:
            peak_gib[e["stage"]] = max(peak_gib.get(e["stage"], 0.0), e["peak_gib"])
    return dict(stages=stages, total=round(sum(stages.values()), 2), peak_gib=peak_gib, entries=entries)


def _precision(recipe: str) -> str:
    from quantkit.calibrate.alpha_search import Rule
    from quantkit.diagnose.budget import candidate_schemes
    from quantkit.formats.constants import WeightScales
    from quantkit.formats.schemes import SCHEMES
    from quantkit.quantize.recipe import Backend, load_recipe

    r = load_recipe(recipe)
    if r.backend != Backend.QUANTKIT:  # a peer's preset: its recipe name says which (nvfp4_ct, nvfp4_ct_gptq, ...)
        return r.name
    scheme = SCHEMES.get(r.scheme)
    label = "BF16" if r.scheme == UNQUANTIZED else scheme.precision if scheme is not None else r.name
    chosen = [s for _, s in r.module_schemes] + list(candidate_schemes(r) if r.bit_budget else [])
    mixed = sorted({SCHEMES[s].precision if s in SCHEMES else "BF16" for s in chosen} - {label}, reverse=True)
    label = "/".join([label, *mixed])  # mixed precision by module: e.g. W4A4/W8A8
    smoothing = "" if r.smoothquant is None else "+AWQ" if r.smoothquant.scales == Rule.AWQ else "+SQ"
    return (
        label
        + _rotation_label(r.rotation)
        + smoothing
        + ("(search)" if r.smoothquant and r.smoothquant.search_alpha else "")
        + _search_error_label(r.smoothquant)
        + (f"+{scheme.method}" if scheme is not None and scheme.method else "")
        + ("+4/6(W)" if r.weight_scales == WeightScales.FOUR_OVER_SIX and not (scheme and scheme.method) else "")
        + ("+MSE" if r.weight_scales == WeightScales.MSE else "")
        + ("+GPTQ" if r.gptq else "")
        + ("(act-order)" if r.gptq and r.gptq.act_order else "")
        + (" (static)" if r.static_activations else "")
        + (f"@{r.bit_budget.avg_bits:g}b" if r.bit_budget else "")
    )


def _search_error_label(smoothquant) -> str:
    """(parent): the searched error is the parent module's output (weights alone quantized), (W): the consumers'
    products with the weights alone quantized, "" the served products (or no search)."""
    if smoothquant is None or not smoothquant.search_weights_only:
        return ""
    return "(parent)" if smoothquant.search_parent_output else "(W)"


def _rotation_label(rotation) -> str:
    """+Rot (residual rotation; +Rot16 block-diagonal of 16; +Rot16o with the online transform at o_proj too), +Had16
    (no residual rotation: the online Hadamard of 16 at every quantized input), "" without rotation."""
    if rotation is None:
        return ""
    if not rotation.residual:
        return f"+Had{rotation.down_block or ''}"
    return f"+Rot{rotation.block or ''}{'o' if rotation.online_o else ''}"


OUTLIER_FIGURES = (
    "max_residual",
    "max_linear_input",
    "top_sink_ratio",
    "sink_rate_mean",
    "first_token_mass_mean",
    "max_residual_kurtosis",
)


def _outliers(study: Study, label: str) -> dict[str, float] | None:
    """Headline diagnostics of the source checkpoint (quantkit.diagnose summary) for the report's outlier columns."""
    path = study._artifact_file("diagnose", label)
    if not path.exists():
        return None
    summary = json.loads(path.read_text())["summary"]
    return {
        k: summary[k] for k in OUTLIER_FIGURES if isinstance(summary.get(k), (int, float)) and math.isfinite(summary[k])
    }


def _sensitivity(study: Study) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """{model label: its source's per-projection-kind SNR tables} (`quantkit diagnose`'s `sensitivity`, recipe ->
    kind -> {mean_db, min_db, worst_layer}; the per-layer values left out) for the models diagnosed so far."""
    out = {}
    for label in study.spec.models:
        path = study._artifact_file("diagnose", label)
        if path.exists():
            tables = json.loads(path.read_text()).get("sensitivity") or {}
            out[label] = {recipe: _kind_cells(table) for recipe, table in tables.items()}
    return out


def _checkpoint_sensitivity(study: Study, key: str) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """{model label: {recipe: per-kind SNR table of its checkpoint}} from the quality stage's artifacts (`quantkit
    quality`'s `key`: `sensitivity` per projection kind, `block_sensitivity` per block; the per-layer values left
    out), in the spec's recipe order, rows with an empty table left out; {} without."""
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    for label in study.spec.models:
        for recipe in study.spec.recipes:
            path = study.artifact("quality", label, recipe) if recipe != BASELINE else None
            table = json.loads(path.read_text()).get(key) if path is not None and path.exists() else None
            if table:  # (an artifact from before block SNR has no block_sensitivity; a peer's no per-projection one)
                out.setdefault(label, {})[recipe] = _kind_cells(table)
    return out


def _kind_cells(table: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A per-projection-kind SNR table (`quantkit.metrics.sensitivity_by_kind`) without its per-layer values."""
    return {kind: {k: v for k, v in cell.items() if k != "layers"} for kind, cell in table.items()}


def _smoothed_inputs(checkpoint_dir: Path) -> dict[str, float]:
    """A SmoothQuant checkpoint's own outlier figures: max |X| over the inputs of the linears it smoothed, before
    and after the fold (on its calibration windows; smoothquant.json). {} for a checkpoint without SmoothQuant.
    Inputs it left alone (down_proj, unless the recipe smooths up -> down) keep the source's figures."""
    path = checkpoint_dir / "smoothquant.json"
    mappings = json.loads(path.read_text())["mappings"] if path.exists() else []
    if not mappings:
        return {}
    return {
        "smoothed_input_max_before": max(m["act_max_before"] for m in mappings),
        "smoothed_input_max_after": max(m["act_max_after"] for m in mappings),
    }


def _now() -> str:
    import datetime

    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
