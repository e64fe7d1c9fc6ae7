"""The distribution's layout: import names, entry points, the vLLM metadata alias."""

import importlib.metadata as metadata
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_top_level_folders_import_under_quantkit_only(tmp_path):
    """As installed (run from elsewhere), kernels/ pipelines/ evals/ resolve only under `quantkit.`."""
    probe = (
        "import importlib.util, json\n"
        "names = ('kernels', 'pipelines', 'evals')\n"
        "print(json.dumps({n: [getattr(importlib.util.find_spec(p + n), 'origin', None)"
        " for p in ('quantkit.', '')] for n in names}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    for name, (mapped, bare) in json.loads(out.stdout).items():
        assert Path(mapped) == REPO / name / "__init__.py"
        assert bare is None or not Path(bare).is_relative_to(REPO), f"bare '{name}' resolves to our folder"


def test_console_command_and_plugin_entry_point():
    out = subprocess.run([Path(sys.executable).parent / "quantkit", "info"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "vLLM plugin entry point: quantkit.serve.plugin:register" in out.stdout
    eps = metadata.entry_points(group="vllm.general_plugins")
    assert [ep.value for ep in eps if ep.name == "quantkit"] == ["quantkit.serve.plugin:register"]


def test_lm_eval_sees_a_vllm_version():
    import vllm

    version = metadata.version("vllm")
    assert version.split("+")[0] == vllm.__version__.split("+")[0]
    import lm_eval.models.vllm_causallms  # noqa: F401  (its import-time version check must pass)
