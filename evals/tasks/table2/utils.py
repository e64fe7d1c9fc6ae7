"""Glue for the table2 YAMLs (lm-eval's `!function utils.x` resolves next to the YAML file)."""

from quantkit.evals.scoring import sandboxed_pass_at_k


def pass_at_k(references: list[str], predictions: list[list[str]], k: list[int] | None = None) -> dict[str, float]:
    """lm-eval's cruxeval metric under its own name, its programs run in quantkit's sandbox (`sandboxed_pass_at_k`)."""
    return sandboxed_pass_at_k(predictions, k)
