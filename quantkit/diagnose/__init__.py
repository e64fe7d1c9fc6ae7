"""Outlier diagnostics (paper 000 sec. 2/3.3, paper 002 eq. 1-2, paper 004 sec. 3): residual sinks, massive
activations, attention sinks, norm weights, kurtosis and per-layer quantization error of a checkpoint.

- `stats`: streaming moments and per-channel accumulators (memory independent of the token count).
- `observe`: the forward hooks, registered only while diagnosing.
- `run`: `diagnose(model_dir, ...)`, `diagnose_model(model, tokens, ...)`, outputs.
- `plots`: the papers' figures as PNG/SVG files or inline SVG text.
- `cli`: `quantkit diagnose MODEL_DIR`; `defaults`: its default settings (no torch import).
Definitions, units and a measured example: docs/diagnostics.md.
"""
