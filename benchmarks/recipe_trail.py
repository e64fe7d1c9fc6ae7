"""Follow a recipe's fields through `quantkit quantize` (issue 52, item 2): which modules read them, in what order.

Every read of a field of the recipe (`quantkit.quantize.recipe`'s dataclasses: the Recipe and its settings) or of
the plan resolved from it (`quantkit.quantize.plan`'s dataclasses) is recorded with the module whose code reads it,
unless that is the object's own module (its methods reading their own fields).
The reads, in order, collapse into *stays* (consecutive reads in one module); a *return* is a stay in a module that
control had already left (the issue's "climbs back"). Reads from outside quantkit (dataclasses' own repr, copy) do
not count. A tiny random checkpoint, quantized by each recipe on both paths (whole model, streaming), on the CPU.

    .venv/bin/python benchmarks/recipe_trail.py [--recipes w4a4_nvfp4 w4a4_nvfp4_sq_gptq ...]

Prints one row per (recipe, path): reads, modules, stays, returns, and the stays in order.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DEFAULT_RECIPES = (
    "w4a4_nvfp4",
    "w8a8_fp8_block_sq",
    "w4a4_nvfp4_sq_gptq",
    "w4a4_nvfp4_rot_gptq",
    "mixed_fp8_attn_nvfp4",
)


@contextmanager
def traced_reads(modules: list, reads: list[str]) -> Iterator[None]:
    """While open: every attribute read of an instance of a dataclass defined in `modules` appends the reading
    module's name (quantkit modules only) to `reads`."""
    classes = [
        obj
        for module in modules
        for obj in vars(module).values()
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__
    ]
    saved = {cls: cls.__dict__.get("__getattribute__") for cls in classes}

    def read(self, name: str):
        if not name.startswith("__"):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("quantkit.") and caller != type(self).__module__:  # not the object's own methods
                reads.append(caller)
        return object.__getattribute__(self, name)

    for cls in classes:
        cls.__getattribute__ = read  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, original in saved.items():
            if original is None:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = original  # type: ignore[method-assign]


def stays(reads: list[str]) -> list[str]:
    """Consecutive reads in one module collapsed into one stay."""
    return [m for i, m in enumerate(reads) if i == 0 or reads[i - 1] != m]


def returns(trail: list[str]) -> int:
    """Stays in a module that an earlier stay had already left."""
    return sum(1 for i, m in enumerate(trail) if m in trail[:i])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES))
    args = parser.parse_args(argv)

    import torch

    from quantkit.models.tiny import build_tiny_checkpoint
    from quantkit.quantize import plan, recipe
    from quantkit.quantize.checkpoint import quantize_checkpoint
    from quantkit.quantize.provenance import with_calibration
    from quantkit.quantize.recipe import load_recipe

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        source = build_tiny_checkpoint(Path(tmp) / "tiny")
        print("| recipe | path | reads | modules | stays | returns | stays in order |")
        print("|---|---|---:|---:|---:|---:|---|")
        for name in args.recipes:
            settings = load_recipe(name)
            if settings.smoothquant is not None or settings.gptq is not None or settings.rotation is not None:
                settings = with_calibration(settings, 4, 32)  # a short calibration: the trail, not the figures
            for streaming in (False, True):
                reads: list[str] = []
                out = Path(tmp) / f"{name}-{streaming}"
                with traced_reads([recipe, plan], reads):
                    quantize_checkpoint(source, settings, out, streaming=streaming)
                trail = stays(reads)
                short = " > ".join(m.removeprefix("quantkit.") for m in trail)
                path = "streaming" if streaming else "whole model"
                counts = f"{len(reads)} | {len(set(trail))} | {len(trail)} | {returns(trail)}"
                print(f"| {name} | {path} | {counts} | {short} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
