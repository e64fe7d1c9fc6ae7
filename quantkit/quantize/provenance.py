"""Which calibration set a recipe draws: resized by a study, recorded per results row (docs/calibration.md).

A recipe calibrates on windows of `quantkit.data.calibration_windows` (source: the recipe's `calibration_data`,
else the model's default, `quantkit.data.default_calibration_source`) for up to three uses:
- "smoothquant": the per-channel maxima behind the smoothing factors (the recipe's `smoothquant` block;
  paper 000 App. A.4.2 uses 4096 sequences, so the SmoothQuant recipes default to 4096 x 512);
- "gptq": the inputs behind GPTQ's Hessians (the recipe's `gptq` block, default 128 x 512);
- "activation scales": static calibrated activation scales (quantkit's `activation_scale: static`,
  llmcompressor's NVFP4 preset, every modelopt preset; the recipe's `calibration` block, default
  `CalibrationSettings`).
Recipes with dynamic per-token activations and no SmoothQuant (bf16, w8a8_fp8_block, w4a4_nvfp4) draw none.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from quantkit.quantize.plan import calibrates_scales, calibration_windows_of
from quantkit.quantize.recipe import CalibrationSettings, Recipe


def with_calibration(recipe: Recipe, num_sequences: int, seq_len: int) -> Recipe:
    """`recipe` with every calibration set it draws resized to num_sequences x seq_len tokens (the study's
    `calibration` key); a recipe that draws none is returned unchanged."""
    if not all(isinstance(v, int) for v in (num_sequences, seq_len)) or num_sequences < 1 or seq_len < 2:
        raise ValueError(f"calibration needs num_sequences >= 1 and seq_len >= 2, got {num_sequences}, {seq_len}")
    changes: dict[str, Any] = {}
    if recipe.smoothquant is not None:
        changes["smoothquant"] = dataclasses.replace(recipe.smoothquant, num_sequences=num_sequences, seq_len=seq_len)
    if recipe.gptq is not None:
        changes["gptq"] = dataclasses.replace(recipe.gptq, num_sequences=num_sequences, seq_len=seq_len)
    if calibrates_scales(recipe):
        changes["calibration"] = CalibrationSettings(num_sequences=num_sequences, seq_len=seq_len)
    return dataclasses.replace(recipe, **changes) if changes else recipe


def with_calibration_data(recipe: Recipe, source: str) -> Recipe:
    """`recipe` reading its calibration windows from `source` (a `quantkit.data` calibration source)."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"calibration data must be a calibration source string, got {source!r}")
    return dataclasses.replace(recipe, calibration_data=source)


def with_early_stop(recipe: Recipe, tolerance: float | None) -> Recipe:
    """`recipe` with SmoothQuant's early stop at `tolerance` (None: every window); unchanged without SmoothQuant."""
    if recipe.smoothquant is None:
        return recipe
    return dataclasses.replace(recipe, smoothquant=dataclasses.replace(recipe.smoothquant, early_stop=tolerance))


CALIBRATION_KEYS = ("num_sequences", "seq_len", "data", "early_stop")


def apply_calibration(recipe: Recipe, settings: dict[str, Any]) -> Recipe:
    """`recipe` with a study's `calibration` settings (CALIBRATION_KEYS): num_sequences and seq_len together
    (`with_calibration`), data (`with_calibration_data`), early_stop (`with_early_stop`; null: every window).
    ValueError names an unknown key or a bad value."""
    if unknown := sorted(set(settings) - set(CALIBRATION_KEYS)):
        raise ValueError(f"unknown calibration key(s) {unknown}; known: {list(CALIBRATION_KEYS)}")
    if ("num_sequences" in settings) != ("seq_len" in settings):
        raise ValueError("calibration needs num_sequences and seq_len together")
    if "num_sequences" in settings:
        recipe = with_calibration(recipe, settings["num_sequences"], settings["seq_len"])
    if "data" in settings:
        recipe = with_calibration_data(recipe, settings["data"])
    if "early_stop" in settings:
        stop = settings["early_stop"]
        if stop is not None and (isinstance(stop, bool) or not isinstance(stop, (int, float)) or stop < 0):
            raise ValueError(f"calibration early_stop must be a tolerance >= 0 or null, got {stop!r}")
        recipe = with_early_stop(recipe, stop)
    return recipe


def calibration_sets(
    recipe: Recipe, max_positions: int | None = None, model_type: str | None = None
) -> list[dict[str, Any]]:
    """The calibration sets quantizing with `recipe` draws for a model of `model_type`, one dict per use:
    {"use", "source", "num_sequences", "seq_len"} (seq_len as drawn: `quantkit.quantize.plan.calibration_windows_of`,
    the windows the plan draws); [] for a recipe that calibrates nothing. The smoothing step's set is named by its
    rule (`smoothquant.scales`: "smoothquant", or "awq" for AWQ's scales: `Windows.label`)."""
    return [w.record() for w in calibration_windows_of(recipe, max_positions, model_type)]


def checkpoint_calibration(recipe: Recipe, checkpoint_dir: str | Path) -> list[dict[str, Any]]:
    """`calibration_sets` of the checkpoint quantized with `recipe` in `checkpoint_dir`: T cut to its config's
    max_position_embeddings, and the SmoothQuant set as its smoothquant.json records it (the windows the
    factors were actually computed on) where that file exists."""
    checkpoint_dir = Path(checkpoint_dir)
    config = json.loads((checkpoint_dir / "config.json").read_text())
    sets = calibration_sets(recipe, config.get("max_position_embeddings"), config.get("model_type"))
    report = checkpoint_dir / "smoothquant.json"
    if report.exists() and recipe.smoothquant is not None:
        sq = json.loads(report.read_text())
        for s in sets:
            if s["use"] == str(recipe.smoothquant.scales):
                s.update(num_sequences=sq["num_sequences"], seq_len=sq["seq_len"])
    return sets
