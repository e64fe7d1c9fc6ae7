"""Evaluation (import name `quantkit.evals`): lm-evaluation-harness suites against vLLM-served checkpoints.

extract (offline items from pinned packages) -> tasks/ (lm-eval YAML) -> suite.evaluate (results + per-sample
logs) -> degradation (flips, KL, bootstrap noise floor against the BF16 run). docs/evaluation.md has the details.
"""
