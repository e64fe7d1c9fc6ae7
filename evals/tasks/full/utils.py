"""Glue for the full-suite YAMLs (hub datasets; scoring from `quantkit.evals.scoring`)."""

from quantkit.evals.extract import load_rows
from quantkit.evals.scoring import process_mbpp, process_multiple  # noqa: F401 - referenced by the YAMLs


def mbpp_fewshot() -> list[dict]:
    """lm-eval's three MBPP exemplars (task ids 2-4 of the prompt split), from the offline extraction."""
    return [dict(row, is_fewshot=True) for row in load_rows("mbpp")]
