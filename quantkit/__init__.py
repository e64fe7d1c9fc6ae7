"""quantkit: how much an LLM architecture loses in low precision (FP8 E4M3, NVFP4), and why.

Data flow (one sub-package a stage): models -> calibrate -> formats/quantize -> serve -> evals -> report;
docs/architecture.md draws it with the direction of imports.
`quantkit.kernels`, `quantkit.pipelines` and `quantkit.evals` live in the repository's top-level
`kernels/`, `pipelines/` and `evals/` folders (see pyproject.toml).
"""

__version__ = "0.1.0"
