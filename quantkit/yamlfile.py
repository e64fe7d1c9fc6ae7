"""Reading the YAML files users write (recipes, pipeline specs, suites, gate thresholds) with named errors.

A syntax error becomes `YamlSyntaxError` (a QuantkitError: exit 2) naming the file, line and column, instead of
PyYAML's traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from quantkit.errors import QuantkitError


class YamlSyntaxError(QuantkitError, ValueError):
    """A YAML file that does not parse; the message names the file, the line and column (1-based) and the problem."""


def read_yaml(path: str | Path) -> Any:
    """The parsed content of the YAML file at `path` (None for an empty file); YamlSyntaxError on bad syntax."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise YamlSyntaxError(f"{path}: not valid YAML{where}: {problem}") from None
    except UnicodeDecodeError as err:
        raise YamlSyntaxError(f"{path}: not a UTF-8 text file ({err.reason} at byte {err.start})") from None


def shipped_names(folder: Path) -> list[str]:
    """The names of the YAML files shipped in `folder` (the stems of folder/*.yaml), sorted."""
    return sorted(p.stem for p in folder.glob("*.yaml"))


def find_yaml(name_or_path: str | Path, folder: Path) -> Path | None:
    """A name (folder/<name>.yaml) or a YAML path (a .yaml / .yml suffix) -> the file; None where it does not exist."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = folder / f"{name_or_path}.yaml"
    return path if path.exists() else None
