"""The configs quantkit ships as package data, found next to this file (checkout or installed wheel alike).

recipes/<name>.yaml   quantization recipes (quantkit.quantize.recipe.load_recipe)
suites/<name>.yaml    evaluation suites (quantkit.evals.suite.load_suite)
gate.yaml             `quantkit gate` thresholds at their defaults (quantkit.report.gate.load_thresholds)
"""

from pathlib import Path

CONFIGS_DIR = Path(__file__).resolve().parent
RECIPES_DIR = CONFIGS_DIR / "recipes"
SUITES_DIR = CONFIGS_DIR / "suites"
GATE_YAML = CONFIGS_DIR / "gate.yaml"
