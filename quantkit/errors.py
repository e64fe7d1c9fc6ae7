"""quantkit's exception hierarchy: what the user can fix, mapped to exit code 2 by the CLI (docs/errors.md).

Domain errors live beside their checks (CheckpointError in `quantkit.checkpoints`, ResultsError in
`quantkit.report.results`, ...) and derive from `QuantkitError`; each keeps the builtin base its callers
caught before (ValueError, RuntimeError, ...). Errors raised by more than one package are defined here.
"""

from __future__ import annotations

import sys


class QuantkitError(Exception):
    """Bad input or an unrecoverable condition the user can fix; the CLI prints
    `quantkit <command>: error: <message>` and exits 2."""


class NonFiniteStatisticsError(QuantkitError, ValueError, FloatingPointError):
    """Activations (calibration or diagnostics) or parameters hold NaN or Inf; the message names the layers."""


class BackendError(QuantkitError, RuntimeError):
    """A peer's quantization backend (llmcompressor, modelopt) failed; the message names the backend, the
    recipe and the backend's last words."""


class RayExecutorError(QuantkitError, RuntimeError):
    """`quantkit run --executor ray` cannot run: ray is not installed (the `ray` extra), the cluster at
    `--address` cannot be reached, or the spec asks for something the Ray executor cannot schedule."""


# What the CLI reports as `quantkit <command>: error: <message>`, exit 2, instead of a traceback.
BAD_INPUT = (QuantkitError, ValueError, FileNotFoundError, FileExistsError)
EXIT_BAD_INPUT = 2


def print_error(command: str, err: BaseException) -> int:
    """Print `quantkit <command>: error: <message>` to stderr; return EXIT_BAD_INPUT."""
    print(f"quantkit {command}: error: {err}", file=sys.stderr)
    return EXIT_BAD_INPUT
