"""Evaluation (import name `quantkit.evals`): lm-evaluation-harness runs against vLLM-served checkpoints."""
