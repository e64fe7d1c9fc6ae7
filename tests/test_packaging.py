"""A non-editable install finds its configs: recipes, suites (with their lm-eval task YAMLs) and gate thresholds.

The sources are copied out of the checkout, installed with pip (offline, no build isolation: the main
environment's setuptools builds it) into a target folder, and probed by an interpreter started with `-S`
whose sys.path is only the standard library, that target and the environment's site-packages: neither the
checkout nor the editable finder (a .pth hook, which `-S` skips) can supply quantkit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from quantkit.errors import BackendError
from quantkit.evals.suite import TASK_CONFIGS, TASKS_DIR, available_suites, load_suite
from quantkit.quantize.recipe import available_recipes

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
sys.path[:] = json.loads(sys.argv[1]) + [p for p in sys.path if p]  # target, site-packages, then the stdlib
import quantkit
from quantkit.configs import GATE_YAML
from quantkit.evals.suite import TASK_CONFIGS, TASKS_DIR, available_suites, load_suite
from quantkit.quantize.recipe import available_recipes, load_recipe
from quantkit.report.gate import Thresholds, load_thresholds
print(json.dumps({
    "quantkit": quantkit.__file__,
    "recipes": {name: load_recipe(name).name for name in available_recipes()},
    "suites": {name: load_suite(name).name for name in available_suites()},
    "task_files": sorted({str(p.relative_to(TASKS_DIR)) for dirs in TASK_CONFIGS.values() for d in dirs
                          for p in d.iterdir() if p.is_file()}),
    "gate_is_default": load_thresholds(GATE_YAML) == Thresholds(),
}))
"""


def _sources(dest: Path) -> Path:
    """Copy what the build reads (pyproject.toml, README.md, the package folders it maps) to `dest`."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    ignore = shutil.ignore_patterns("__pycache__", "offline", "*.egg-info")
    for folder in {"quantkit", *setuptools["package-dir"].values()}:
        shutil.copytree(REPO / folder, dest / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    return dest


def test_installed_wheel_finds_recipes_suites_and_gate(tmp_path):
    src, target, cwd = _sources(tmp_path / "src"), tmp_path / "target", tmp_path / "cwd"
    cwd.mkdir()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--quiet",
            "--target",
            str(target),
            str(src),
        ],
        check=True,
        capture_output=True,
        cwd=cwd,
    )
    site = [p for p in sys.path if Path(p).name == "site-packages"]  # the environment's dependencies
    out = subprocess.run(
        [sys.executable, "-S", "-c", PROBE, json.dumps([str(target), *site])], cwd=cwd, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert Path(found["quantkit"]).is_relative_to(target), "quantkit was imported from outside the install"
    assert found["recipes"] == {name: name for name in available_recipes()}
    assert found["suites"] == {name: load_suite(name).name for name in available_suites()}  # full: alias of table2
    assert found["task_files"] == sorted(
        {
            str(p.relative_to(TASKS_DIR))
            for dirs in TASK_CONFIGS.values()
            for d in dirs
            for p in d.iterdir()
            if p.is_file()
        }
    )
    assert found["gate_is_default"]


def test_llmcompressor_venv_outside_a_checkout_names_the_variable(monkeypatch, tmp_path):
    """An installed quantkit has no .venv-llmcompressor beside it: the error says which variable to set."""
    from quantkit.quantize import llmcompressor_backend as backend

    monkeypatch.delenv(backend.PYTHON_ENV, raising=False)
    assert backend.CHECKOUT == REPO
    monkeypatch.setattr(backend, "CHECKOUT", tmp_path / "site-packages")
    with pytest.raises(BackendError, match=r"outside a source checkout .* set QUANTKIT_LLMCOMPRESSOR_PYTHON"):
        backend.llmcompressor_python()
