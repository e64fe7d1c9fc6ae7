"""The distribution's layout: import names, entry points, the vLLM metadata alias, the direction of imports."""

import ast
import importlib.metadata as metadata
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_top_level_folders_import_under_quantkit_only(tmp_path):
    """As installed (run from elsewhere), configs/ kernels/ pipelines/ evals/ resolve only under `quantkit.`."""
    probe = (
        "import importlib.util, json\n"
        "names = ('configs', 'kernels', 'pipelines', 'evals')\n"
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


# Installed import name of each source folder (pyproject.toml [tool.setuptools.package-dir]).
SOURCE_ROOTS = {
    "quantkit": "quantkit",
    "configs": "quantkit.configs",
    "kernels": "quantkit.kernels",
    "evals": "quantkit.evals",
    "pipelines": "quantkit.pipelines",
}
LEAVES = (
    "quantkit.errors",
    "quantkit.atomic",
    "quantkit.checkpoints",
    "quantkit.yamlfile",
)  # shared by every layer, import only leaves
SERVE_ENTRIES = ("quantkit.serve.engine", "quantkit.serve.checkpoint_check")  # what consumers of serving may use


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module that installs under `quantkit`."""
    modules = {}
    for folder, package in SOURCE_ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join((package, *parts))] = path
    return modules


def _imported(path: Path) -> set[str]:
    """The quantkit modules a file imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)  # `from quantkit import serve`
    return {n for n in names if n == "quantkit" or n.startswith("quantkit.")}


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_imports_point_one_way():
    """Imports point formats <- quantize <- serve, never back:

    - quantkit.formats (numeric formats and the scheme registry) imports only itself and the leaves
      (quantkit.errors, .atomic, .checkpoints); the leaves import only leaves;
    - quantkit.kernels imports only itself, formats and the leaves (serve dispatches to it);
    - quantkit.quantize imports nothing from serve (nor from kernels, evals, pipelines, report);
    - evals, pipelines and report use serving only through its public entries, quantkit.serve.engine
      (engine settings) and quantkit.serve.checkpoint_check (the servability check).
    """
    allowed_only = {
        "quantkit.formats": ("quantkit.formats", *LEAVES),
        "quantkit.kernels": ("quantkit.kernels", "quantkit.formats", *LEAVES),
        **{leaf: LEAVES for leaf in LEAVES},
    }
    forbidden = {
        "quantkit.serve": ("quantkit.quantize",),  # the served numerics are the formats' (routed experts included)
        "quantkit.quantize": (
            "quantkit.serve",
            "quantkit.kernels",
            "quantkit.evals",
            "quantkit.pipelines",
            "quantkit.report",
            "quantkit.cli",
        ),
    }
    consumers = ("quantkit.evals", "quantkit.pipelines", "quantkit.report")
    wrong = []
    for module, path in _modules().items():
        for name in sorted(_imported(path) - {"quantkit"}):
            for package, allowed in allowed_only.items():
                if _within(module, (package,)) and not _within(name, allowed):
                    wrong.append(f"{module} imports {name}")
            for package, banned in forbidden.items():
                if _within(module, (package,)) and _within(name, banned):
                    wrong.append(f"{module} imports {name}")
            if _within(module, consumers) and _within(name, ("quantkit.serve",)) and not _within(name, SERVE_ENTRIES):
                wrong.append(f"{module} imports {name} (serving internals)")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (each an import circle), by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_between_modules_or_packages():
    """No module imports one that (directly or not) imports it back, at any depth (function-level imports too), and
    no package (quantkit.calibrate, .quantize, .serve, ..., each top-level module its own) does: the arrows of the
    layering point one way."""
    modules = _modules()

    def owner(name: str) -> str | None:  # the module a dotted import name resolves to
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    module_graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        deps = {owner(n) for n in _imported(path)} - {None, module, "quantkit"}
        module_graph[module] = {d for d in deps if not module.startswith(d + ".")}  # a package's own __init__
    package_graph: dict[str, set[str]] = {}
    for module, deps in module_graph.items():
        package_graph.setdefault(package(module), set()).update(
            package(d) for d in deps if package(d) != package(module)
        )
    assert not _cycles(module_graph), f"import circles between modules: {_cycles(module_graph)}"
    assert not _cycles(package_graph), f"import circles between packages: {_cycles(package_graph)}"
