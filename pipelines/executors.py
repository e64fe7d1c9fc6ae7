"""The study's stage table (pipelines/study.py) on a Ray cluster: `quantkit run SPEC --executor ray [--address ADDR]`.

The local executor (`Study.run` without an executor) runs every stage in this process, in table order. The Ray
executor schedules the same stages as Ray tasks, by scope (SCOPES in pipelines/study.py):

- per model, one task with its model-scope stages (checkpoint, diagnose);
- then, per (model, recipe), one task with the recipe's chain of recipe-scope stages (quantize, eval), each
  chain followed by the asked-scope stages the spec asks for on that row (numerics, reference);
- per quantized recipe, one task with its quantized-scope stages (degradation, and quality where the spec asks)
  once its chain and its model's bf16 chain are done;
- study-scope stages (report) on the driver, at the end.

Every task runs its stages through `Study._do`: the same artifacts in the same run directory, the same atomic
writes and caching (a finished artifact is never redone, a killed task loses only its stage in flight) and the
same timings.json; only the order between targets differs from the local executor. The driver holds the run
directory's lock for the whole study.

Resources: a chain asks Ray for tensor_parallel_size GPUs (and 1 CPU) when the cluster has GPUs, else for
tensor_parallel_size CPUs (vLLM's CPU ranks); model and degradation tasks, which run on CPU, for 1 CPU.
Storage: tasks read and write the run directory, the zoo directory and local model sources at the driver's
absolute paths, so on several nodes these must be shared storage mounted at the same path.
Failures: no retries (max_retries=0). A task's StageError names its stage, model and recipe; a worker that dies
(SIGKILL, out of memory, lost node) is reported as a StageError naming the first stage of its task whose
artifact is missing. The other tasks go on (the dependents of a failed one are not started); at the end the
driver raises the first failure, naming the others. Progress: a tqdm bar over finished tasks on the driver;
Ray forwards the tasks' own lines (stage timings, eval bars) prefixed with the task's name.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any, cast

from tqdm import tqdm

from quantkit.errors import BAD_INPUT, RayExecutorError
from quantkit.pipelines.study import (
    BASELINE,
    STAGE_BY_NAME,
    Stage,
    StageError,
    Study,
    StudySpec,
    describe_target,
    read_timings,
)

SCOPE_ORDER = ("model", "recipe", "asked", "quantized", "study")  # the order the Ray executor runs scopes in
TASK_KINDS = {"model": "model", "recipe": "chain", "quantized": "compare"}  # a task's name: "<kind> <model> [<recipe>]"
CONNECT_TIMEOUT_S = 10.0  # ray.init retries an unreachable address for minutes; a TCP connect answers in this


@dataclass(frozen=True)
class Task:
    """One Ray task: `stages` (names, in table order, all of `scope`; a chain also its row's asked-scope stages)
    for the target (label, recipe)."""

    scope: str
    label: str
    recipe: str | None
    stages: tuple[str, ...]

    @property
    def name(self) -> str:
        """Ray's task name, also the worker's process title while it runs (`ray::chain ga w4a4_nvfp4`)."""
        return " ".join(x for x in (TASK_KINDS[self.scope], self.label, self.recipe) if x)


def run_task(spec: StudySpec, run_dir: str, task: Task, sources: dict[str, str]) -> dict[str, str]:
    """The body of every Ray task, on a worker: the task's stages through `Study._do`. `sources`: the model
    checkpoints already resolved (label -> directory); returns them with any this task resolved."""
    import torch

    from quantkit.serve.engine import offline_environment

    study = Study(spec, run_dir)
    study.sources = {label: Path(path) for label, path in sources.items()}
    if not torch.cuda.is_available():
        _use_assigned_cpus(torch)
    offline_environment(cache_dir=study.dir / "cache")
    for name in task.stages:
        study._do(STAGE_BY_NAME[name], task.label, task.recipe)
    return {label: str(path) for label, path in study.sources.items()}


def _use_assigned_cpus(torch: ModuleType) -> None:
    """On a CPU node, keep this task's torch and vLLM threads to the number of CPUs Ray assigned it: otherwise every
    vLLM engine binds one OpenMP thread to each of the node's cores (offline_environment's default), and the
    engines of concurrent chains compete for the same cores while Ray counts each as using only its request."""
    import ray

    cpus = max(int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)), 1)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # OpenMP threads: OMP_NUM_THREADS, set by Ray to `cpus`
    torch.set_num_threads(cpus)


class RayExecutor:
    """Runs a study's stages as Ray tasks (module docstring); a context manager. Entering connects: `address`
    host:port or ray://host:port (a running cluster, `ray start --head`), `auto` (the cluster this machine
    belongs to), `local` or None (None: $RAY_ADDRESS if set) to start a Ray instance on this machine; a
    connection this process already holds is reused when no address is given. Leaving disconnects (and stops
    an instance it started). RayExecutorError when ray is not installed or the cluster cannot be reached."""

    def __init__(self, address: str | None = None) -> None:
        self.ray = _import_ray()
        self.address = address if address is not None else os.environ.get("RAY_ADDRESS")
        self._connected = False

    def __enter__(self) -> RayExecutor:
        if self.ray.is_initialized() and self.address is None:
            return self
        try:
            if self.address in (None, "local"):
                self.ray.init(address=self.address, include_dashboard=False)
            else:
                _check_reachable(self.address)
                self.ray.init(address=self.address)
        except ConnectionError as err:
            raise RayExecutorError(f"cannot connect to a Ray cluster at {self.address!r}: {err}") from err
        self._connected = True
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        if self._connected:
            self.ray.shutdown()
            self._connected = False

    @staticmethod
    def check(spec: StudySpec) -> None:
        """RayExecutorError for a spec the Ray executor cannot schedule (call it before connecting)."""
        if (dp := spec.parallel["data_parallel_size"]) != 1:
            raise RayExecutorError(
                f"parallel.data_parallel_size is {dp}: lm-eval's data parallelism starts Ray actors "
                "of its own and shuts Ray down inside the task; the Ray executor already runs the "
                "recipes in parallel, so set data_parallel_size: 1 (or run without --executor ray)"
            )

    def run(self, study: Study, stages: Sequence[Stage]) -> None:
        """Every target of `stages` as Ray tasks, then the study-scope stages here; raises StageError."""
        ray = self.ray
        self.check(study.spec)
        if not ray.is_initialized():
            raise RuntimeError("RayExecutor.run needs a connection: use `with RayExecutor(address) as executor`")
        scopes = [SCOPE_ORDER.index(stage.scope) for stage in stages]
        if scopes != sorted(scopes):
            raise RuntimeError(f"the Ray executor runs scopes in the order {SCOPE_ORDER}; the stage table does not")
        by_scope = {scope: tuple(s.name for s in stages if s.scope == scope) for scope in SCOPE_ORDER}
        spec, run_dir = _portable(study.spec), str(study.dir.resolve())
        models, recipes = list(spec.models), list(spec.recipes)
        remote = ray.remote(max_retries=0)(run_task)
        tp = spec.parallel["tensor_parallel_size"]
        chain_resources = (
            dict(num_cpus=1, num_gpus=tp) if ray.cluster_resources().get("GPU", 0) > 0 else dict(num_cpus=tp)
        )
        _check_schedulable(ray, chain_resources, tp)
        sources: dict[str, str] = {}
        chains: set[tuple[str, str]] = set()  # (label, recipe) whose chain finished
        pending: dict[Any, Task] = {}  # ObjectRef -> its task
        failures: list[StageError] = []

        def start(scope: str, label: str, recipe: str | None) -> None:
            """Submit the task of (scope, label, recipe); with no stage of that scope to run, go on to its
            dependents."""
            extra = (
                tuple(s for s in by_scope["asked"] if study.runs(s, label, cast(str, recipe)))
                if scope == "recipe"
                else ()
            )  # a row's chain carries its asked-scope stages (they need its checkpoint)
            own = by_scope[scope]
            if scope == "quantized":  # the stages the spec may leave out (quality) where it does
                own = tuple(s for s in own if study.runs(s, label, cast(str, recipe)))
            task = Task(scope, label, recipe, own + extra)
            if not task.stages:
                finished(task)
                return
            resources = chain_resources if scope == "recipe" else dict(num_cpus=1)
            known = {label: sources[label]} if label in sources else {}
            pending[remote.options(name=task.name, **resources).remote(spec, run_dir, task, known)] = task

        def finished(task: Task) -> None:
            """Start what waited for `task`: a model's chains; a quantized recipe's comparison with bf16."""
            if task.scope == "model":
                for recipe in recipes:
                    start("recipe", task.label, recipe)
            elif task.scope == "recipe":
                recipe_done = cast(str, task.recipe)  # a recipe-scope task's (start("recipe", label, recipe))
                chains.add((task.label, recipe_done))
                ready = (
                    [r for r in recipes if r != BASELINE and (task.label, r) in chains]
                    if recipe_done == BASELINE
                    else [recipe_done]
                    if (task.label, BASELINE) in chains
                    else []
                )
                for recipe in ready:
                    start("quantized", task.label, recipe)

        total = len(models) * (
            bool(by_scope["model"])
            + len(recipes) * bool(by_scope["recipe"])
            + (len(recipes) - 1) * bool(by_scope["quantized"])
        )
        with tqdm(total=total, desc=f"study {spec.name} (ray)", unit="task") as bar:
            for label in models:
                start("model", label, None)
            while pending:
                [ref], _ = ray.wait(list(pending), num_returns=1)
                task = pending.pop(ref)
                try:
                    sources.update(ray.get(ref))
                except ray.exceptions.RayError as err:
                    failures.append(_failure(study, task, err))
                    tqdm.write(f"task {task.name}: {failures[-1]}", file=sys.stderr)
                else:
                    finished(task)
                bar.update(1)
        if failures:
            others = "".join(f"; also: {f}" for f in failures[1:])
            raise StageError(f"{failures[0]}{others}", bad_input=all(f.bad_input for f in failures)) from failures[0]
        study.timings = read_timings(study.dir)  # the tasks' entries, for the report
        for name in by_scope["study"]:
            study._do(STAGE_BY_NAME[name], None, None)


def _check_schedulable(ray: ModuleType, resources: dict[str, int], tp: int) -> None:
    """RayExecutorError when no node of the cluster has the CPUs or GPUs a chain asks for (Ray would wait forever)."""
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    for key, kind in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
        largest = max((node.get(kind, 0) for node in nodes), default=0)
        if resources.get(key, 0) > largest:
            raise RayExecutorError(
                f"a chain asks for {resources[key]} {kind}(s) on one node (tensor_parallel_size {tp}); "
                f"the cluster's largest node has {largest:g}"
            )


def _failure(study: Study, task: Task, err: Exception) -> StageError:
    """The StageError of a failed task: the one it raised, or, when its worker died or it raised outside a stage,
    one naming the first stage of the task whose artifact is missing."""
    cause = getattr(err, "cause", None)  # RayTaskError: what the task raised
    if isinstance(cause, StageError):
        return cause
    stage = next(
        (
            name
            for name in task.stages
            if (path := study.artifact(name, task.label, task.recipe)) is not None and not path.exists()
        ),
        task.stages[-1],
    )
    what = (
        f"{type(cause).__name__}: {cause}"
        if cause is not None
        else f"{type(err).__name__}: the Ray task {task.name!r} did not finish: {str(err).strip().splitlines()[0]}"
    )
    return StageError(
        f"stage {stage!r} failed{describe_target(task.label, task.recipe)} ({study.dir}): {what}",
        bad_input=isinstance(cause, BAD_INPUT),
    )


def _portable(spec: StudySpec) -> StudySpec:
    """`spec` with the zoo directory and local model sources as absolute paths: tasks run in other working
    directories (on other nodes)."""
    models = {
        label: source
        if source.startswith(("zoo:", "model:")) or not Path(source).exists()
        else str(Path(source).resolve())
        for label, source in spec.models.items()
    }
    return dataclasses.replace(
        spec, models=models, zoo={**spec.zoo, "dir": str(Path(spec.zoo.get("dir", "zoo")).resolve())}
    )


def _import_ray() -> ModuleType:
    try:
        import ray
    except ImportError as err:
        raise RayExecutorError(
            f"--executor ray needs ray ({err}): pip install 'quantkit[ray]' (`make setup` installs it)"
        ) from err
    return ray


def _check_reachable(address: str) -> None:
    """Refuse an address whose host:port takes no TCP connection within CONNECT_TIMEOUT_S (`auto` is Ray's to find)."""
    if address == "auto":
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise RayExecutorError(f"--address {address!r}: expected host:port, ray://host:port, auto or local")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise RayExecutorError(
            f"cannot reach a Ray cluster at {address}: {err} (is `ray start --head` running there, "
            "and its port open to this machine?)"
        ) from err
