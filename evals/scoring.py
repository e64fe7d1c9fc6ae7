"""How the suite's generated answers are checked (lm-eval `process_results` functions live here).

Conventions (every function returns 1 for correct, 0 for wrong, per sample; lm-eval averages):
- Numbers (GSM8K, MGSM): the final answer is the content of the last `\\boxed{...}`, else the number after
  the last `####`, else after the last "answer is", else the last number in the response. Numbers compare
  as values (|a - b| <= 1e-6): `1,000` and `1000` are equal, `\\frac{1}{2}` is `1/2` (a comma followed by
  exactly three digits groups thousands, any other comma is a decimal comma), `-57/2` equals `-28.5`, a
  trailing `.0`, `$` or `%` does not matter.
- MATH: the last `\\boxed{...}` or "final answer is $...$" of the response against the item's `answer` (the
  reference's "final answer is $...$", `extract.math_rows`), after a light LaTeX normalization
  (`normalize_math`); no symbolic equivalence.
- Code (HumanEval, MBPP, CRUXEval, MultiPL-E): the program runs (`execution.run_program`, opt-in only);
  pass@1: one greedy sample, or with `repeats: n` samples the fraction that pass (pass@k for k > 1 is not
  computed). A whole script the model wrote (EvalPlus's protocol) is cut at its closing fence and reduced to
  its definitions (`script_definitions`) before it runs.
"""

from __future__ import annotations

import ast
import re

from quantkit.evals.execution import pass_at_k, run_program

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+"


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def parse_number(text: str) -> float | None:
    """The value of a number written as in the module docstring, or None."""
    text = text.strip().strip("$%").replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    text = text.replace(",", ".")
    try:
        if "/" in text:
            num, den = text.split("/")
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def final_number(response: str) -> float | None:
    """The response's final numeric answer (module docstring order), or None."""
    boxed = last_boxed(response)
    if boxed is not None:
        candidates = re.findall(_NUMBER, re.sub(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", r"\1/\2", boxed))
    elif "####" in response:
        candidates = re.findall(_NUMBER, response.rsplit("####", 1)[1])[:1]
    elif "answer is" in response:
        candidates = re.findall(_NUMBER, response.rsplit("answer is", 1)[1])[:1]
    else:
        candidates = re.findall(_NUMBER, response)
    return parse_number(candidates[-1]) if candidates else None


def numbers_match(response: str, gold: str) -> int:
    """1 when the response's `final_number` equals the number `gold` (|a - b| <= 1e-6), else 0; ValueError when
    `gold` is not a number."""
    predicted, expected = final_number(response), parse_number(gold)
    if expected is None:
        raise ValueError(f"gold answer {gold!r} is not a number")
    return int(predicted is not None and abs(predicted - expected) <= 1e-6)


def normalize_math(answer: str) -> str:
    """Strip spacing and presentation-only LaTeX: `\\left`, `\\right`, `\\!`, `dfrac`/`tfrac`, `$`, a final '.'."""
    answer = re.sub(r"\\left|\\right|\\!|\\,|\\;|\$|\s", "", answer)
    answer = answer.replace("dfrac", "frac").replace("tfrac", "frac")
    return answer.rstrip(".")


def math_answer(response: str) -> str | None:
    """The response's MATH answer: the last `\\boxed{...}`, else the last "final answer is $...$", else None."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    found = re.findall(r"final answer is \$(.*?)\$", response)
    return found[-1] if found else None


# --- lm-eval process_results(doc, results) -> {metric: value} -------------------------------------


def process_numeric(doc: dict, results: list[str]) -> dict[str, int]:
    """GSM8K / MGSM: {"exact_match": `numbers_match`(results[0], doc["answer"])}."""
    return {"exact_match": numbers_match(results[0], doc["answer"])}


def process_math(doc: dict, results: list[str]) -> dict[str, int]:
    """MATH: {"exact_match": 1} when results[0]'s `math_answer` equals doc["answer"] after `normalize_math`, else 0."""
    predicted = math_answer(results[0])
    return {"exact_match": int(predicted is not None and normalize_math(predicted) == normalize_math(doc["answer"]))}


def _pass_at_1(programs: list[str], language: str = "py") -> dict[str, float]:
    passed = sum(run_program(p, language) for p in programs)
    return {"pass@1": pass_at_k(len(programs), passed, 1)}


def sandboxed_pass_at_k(predictions: list[list[str]], k: list[int] | int | None = None) -> dict[str, float]:
    """lm-eval's cruxeval `pass_at_k` metric, each program run in quantkit's sandbox (`execution.run_program`,
    opt-in, isolated, time-limited) instead of lm-eval's in-process `exec`: {"pass@<k>": mean over items of the
    unbiased pass@k of that item's programs} for each k (default [1])."""
    ks = [k] if isinstance(k, int) else list(k or [1])
    passed = [(len(programs), sum(run_program(p) for p in programs)) for programs in predictions]
    return {f"pass@{kv}": sum(pass_at_k(n, c, kv) for n, c in passed) / max(len(passed), 1) for kv in ks}


def humaneval_program(doc: dict, completion: str) -> str:
    """The HumanEval program to run: prompt + completion, the problem's tests, then `check(<entry_point>)`."""
    return f"{doc['prompt']}{completion}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def script_definitions(script: str) -> str:
    """A model-written Python script reduced as EvalPlus's `sanitize` does: its top-level imports, function and
    class definitions and assignments, in order (example calls, prints, asserts and `if __name__` blocks
    dropped); EvalPlus also drops definitions the entry point does not reach, which we keep. A script that does
    not parse is returned unchanged (and then fails)."""
    try:
        tree = ast.parse(script)
    except SyntaxError:
        return script
    kept = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)
    return ast.unparse(ast.Module(body=[n for n in tree.body if isinstance(n, kept)], type_ignores=[]))


def humaneval_script_program(doc: dict, completion: str) -> str:
    """HumanEval in EvalPlus's instruct protocol, where the model writes the whole function: the prompt (its
    imports, and the helpers HumanEval/32, 38 and 50's tests call; its docstring-only stub is then redefined),
    the script up to its closing fence with tabs as 4 spaces (EvalPlus's vLLM provider) and `script_definitions`,
    the problem's tests, `check(<entry_point>)`."""
    script = script_definitions(completion.split("\n```")[0].replace("\t", "    "))
    return f"{doc['prompt']}\n{script}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def mbpp_program(doc: dict, completion: str) -> str:
    """The MBPP program to run: the completion up to '[DONE]', the doc's test_setup_code (if any), its test_list."""
    tests = "\n".join(doc["test_list"])
    return f"{completion.split('[DONE]')[0]}\n\n{doc.get('test_setup_code') or ''}\n{tests}\n"


def cruxeval_program(doc: dict, completion: str) -> str:
    """`assert f(...) == ...` answers: the predicted output (after '==') or input (inside `f(...)`)."""
    line = next((ln for ln in completion.strip().splitlines() if ln.strip()), "").strip()
    line = line.split("[/ANSWER]")[0].strip()
    if doc["mode"] == "output":
        predicted = line.split("==", 1)[1].strip() if "==" in line else line
        return f"{doc['code']}\nassert f({doc['input']}) == {predicted}\n"
    predicted = line.removeprefix("assert").strip()
    if "==" in predicted:
        predicted = predicted.rsplit("==", 1)[0].strip()
    if predicted.startswith("f(") and predicted.endswith(")"):
        predicted = predicted[2:-1]
    return f"{doc['code']}\nassert f({predicted}) == {doc['output']}\n"


def _completions(results: list) -> list[str]:
    """One greedy completion ([str]), or the n samples of a `repeats: n` task kept by its filter ([[str, ...]])."""
    return list(results[0]) if results and isinstance(results[0], list) else list(results)


def process_humaneval(doc: dict, results: list) -> dict[str, float]:
    """HumanEval: {"pass@1": fraction of the completions whose `humaneval_program` passes}."""
    return _pass_at_1([humaneval_program(doc, r) for r in _completions(results)])


def process_humaneval_evalplus(doc: dict, results: list) -> dict[str, float]:
    """HumanEval, EvalPlus protocol: {"pass@1": fraction of the completions whose `humaneval_script_program`
    passes}."""
    return _pass_at_1([humaneval_script_program(doc, r) for r in _completions(results)])


def process_mbpp(doc: dict, results: list) -> dict[str, float]:
    """MBPP: {"pass@1": fraction of the completions whose `mbpp_program` passes}."""
    return _pass_at_1([mbpp_program(doc, r) for r in _completions(results)])


def process_cruxeval(doc: dict, results: list) -> dict[str, float]:
    """CRUXEval: {"pass@1": fraction of the completions whose `cruxeval_program` passes}."""
    return _pass_at_1([cruxeval_program(doc, r) for r in _completions(results)])


def process_multiple(doc: dict, results: list) -> dict[str, float]:
    """MultiPL-E: prompt + completion + the language's tests, run by its toolchain."""
    return _pass_at_1([doc["prompt"] + r + "\n" + doc["tests"] for r in _completions(results)], doc["language"])
