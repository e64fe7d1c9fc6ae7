"""Benchmark columns of the report: benchmark key -> (column group, label), in paper 000's Table 2 order.

Keys match after normalization (lowercase, letters and digits only), so a suite's column name ("MMLU-R",
"GSM8k"), the canonical key ("mmlu_r", "gsm8k") and an alias ("mmlu_redux") name the same benchmark.
A benchmark missing from the table is kept, in the group "Other", under its own name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GROUPS = ("Knowledge", "STEM", "Code", "Multilingual", "Commonsense", "Other")
OTHER = "Other"


@dataclass(frozen=True)
class Benchmark:
    """One report column: `key` as written in results, `group` one of GROUPS, `label` as printed."""

    key: str
    group: str
    label: str
    aliases: tuple[str, ...] = ()


# Paper 000's Table 2 columns, plus the offline suites' own (MMLU, HumanEval, the commonsense sets), each in its group.
BENCHMARKS = (
    Benchmark("mmlu", "Knowledge", "MMLU"),
    Benchmark("mmlu_r", "Knowledge", "MMLU-R", ("mmlu_redux", "mmlu_redux_generative")),
    Benchmark("mmlu_p", "Knowledge", "MMLU-P", ("mmlu_pro",)),
    Benchmark("s_gpqa", "Knowledge", "S-GPQA", ("supergpqa",)),
    Benchmark("gpqa_d", "Knowledge", "GPQA-D", ("gpqa_diamond",)),
    Benchmark("gsm8k", "STEM", "GSM8k"),
    Benchmark("math", "STEM", "Math", ("minerva_math",)),
    Benchmark("crux", "Code", "Crux", ("cruxeval",)),
    Benchmark("multipl_e", "Code", "MultiPL_E"),
    Benchmark("mbpp", "Code", "MBPP"),
    Benchmark("humaneval", "Code", "HumanEval"),
    Benchmark("humaneval_mbpp", "Code", "HE+MBPP"),  # the code suite's pooled items (its Avg)
    Benchmark("mmmlu", "Multilingual", "MMMLU"),
    Benchmark("mgsm", "Multilingual", "MGSM"),
    Benchmark("arc_e", "Commonsense", "ARC-E", ("arc_easy",)),  # the commonsense suite (small trained models)
    Benchmark("arc_c", "Commonsense", "ARC-C", ("arc_challenge",)),
    Benchmark("hellaswag", "Commonsense", "HellaSwag"),
    Benchmark("winogrande", "Commonsense", "Winogrande"),
    Benchmark("piqa", "Commonsense", "PIQA"),
)


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_BY_NAME = {_norm(n): b for b in BENCHMARKS for n in (b.key, b.label, *b.aliases)}


def resolve(name: str) -> Benchmark:
    """The table's benchmark for a results key; unknown keys become their own column in group "Other"."""
    return _BY_NAME.get(_norm(name), Benchmark(name, OTHER, name))


def ordered(keys: list[str]) -> list[Benchmark]:
    """The report's columns for these (canonical) keys: by group, then table order, then first appearance."""
    rank = {b.key: i for i, b in enumerate(BENCHMARKS)}
    unique = list(dict.fromkeys(keys))
    benchmarks = [resolve(k) for k in unique]
    return sorted(benchmarks, key=lambda b: (GROUPS.index(b.group), rank.get(b.key, len(rank)), unique.index(b.key)))
