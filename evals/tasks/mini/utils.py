"""Glue for the mini-suite YAMLs (lm-eval's `!function utils.x` resolves next to the YAML file):
items come from the offline extraction (`quantkit.evals.extract`), scoring from `quantkit.evals.scoring`."""

from datasets import Dataset

from quantkit.evals.extract import load_rows
from quantkit.evals.scoring import (  # noqa: F401 - referenced by the YAMLs
    process_cruxeval,
    process_humaneval,
    process_humaneval_evalplus,
    process_math,
    process_mbpp,
    process_numeric,
)


def load(table: str, **_metadata) -> dict[str, Dataset]:
    """lm-eval `custom_dataset`: the extracted table as the `test` split."""
    return {"test": Dataset.from_list(load_rows(table))}


def mbpp_fewshot() -> list[dict]:
    """lm-eval's three MBPP exemplars (task ids 2-4 of the prompt split), marked for the few-shot target."""
    return [dict(row, is_fewshot=True) for row in load_rows("mbpp")]
