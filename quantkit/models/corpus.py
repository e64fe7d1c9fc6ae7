"""Local English text that needs no download.

`stdlib_docstrings()` collects the docstrings of the Python standard library's modules, classes and
functions: real English prose that ships with every Python, so tokenizers and smoke checkpoints can be
built offline and reproducibly (the text depends only on the Python version).
"""

from __future__ import annotations

import importlib
import inspect

STDLIB_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal",
    "email", "functools", "http.client", "inspect", "itertools", "json", "logging", "pathlib", "pickle",
    "random", "re", "shutil", "socket", "statistics", "string", "subprocess", "tarfile", "threading",
    "typing", "unittest", "urllib.request", "zipfile",
)


def stdlib_docstrings(modules: tuple[str, ...] = STDLIB_MODULES, min_chars: int = 40) -> list[str]:
    """Docstrings (>= min_chars characters, whitespace-normalized) of `modules` and their members."""
    texts: list[str] = []
    for name in modules:
        module = importlib.import_module(name)
        objects = [module] + [obj for _, obj in sorted(vars(module).items()) if inspect.isclass(obj) or inspect.isfunction(obj)]
        for obj in objects:
            doc = inspect.getdoc(obj)
            if doc and len(doc) >= min_chars:
                texts.append(" ".join(doc.split()))
    return list(dict.fromkeys(texts))
