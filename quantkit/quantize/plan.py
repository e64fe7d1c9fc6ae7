"""The quantization plan: a recipe resolved once against one model, before any weight is read.

`QuantPlan.resolve(recipe, config, matrices)` decides
- which matrices the scheme encodes (`matrix_schemes`: name -> scheme, in model order) and which stay as the source
  holds them (`ignored`); refused early: one served layer (q/k/v, gate/up, an experts module) split across schemes;
- the steps, in the order both paths run them: rotation (its check windows), SmoothQuant or AWQ (its windows and
  scale search), GPTQ (its windows), static activation scales (their windows); and the weights' decode scales
  (min-max or MSE-searched).
Both quantize paths (`quantkit.quantize.checkpoint`: the whole model; `quantkit.quantize.streaming`: one layer at a
time) and the output config (`quantkit.quantize.output`) read the plan, never the recipe's fields; the provenance
record (`quantkit.quantize.provenance`) is the plan's `calibration_windows`, which also knows the peers' rules.

Calibration windows (`Windows`): N windows of T tokens of one `quantkit.data` calibration source (the recipe's
`calibration_data`, else the model's default). SmoothQuant's T is as asked (more than the model's positions is
refused); GPTQ's, the static scales' and the rotation check's (2 x 128) are cut to the model's positions
(llm-compressor's job takes T as given).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import PretrainedConfig

from quantkit.calibrate.alpha_search import AlphaSearch
from quantkit.data import calibration_windows, describe_calibration_source
from quantkit.formats.constants import WeightScales
from quantkit.formats.experts import EXPERT_MATRIX
from quantkit.formats.schemes import Scheme, scheme_for
from quantkit.quantize.fake_quant import quantized_product, quantized_weight
from quantkit.quantize.recipe import (
    PEER_MODIFIERS,
    Backend,
    CalibrationSettings,
    GPTQSettings,
    Recipe,
    RotationSettings,
    SmoothQuantSettings,
)

ROTATION_CHECK_WINDOWS = (2, 128)  # rotation's function check: N windows of up to T tokens


@dataclass(frozen=True)
class Windows:
    """N calibration windows of T tokens of a `quantkit.data` calibration source, drawn for one use."""

    use: str  # "smoothquant" | "gptq" | "activation scales" | "rotation check": the step that reads them
    num_sequences: int
    seq_len: int
    source: str
    label: str | None = None  # the name the provenance record gives the set (None: `use`), e.g. "awq"

    def tokens(self, tokenizer) -> torch.Tensor:
        """The (N, T) int64 windows (`quantkit.data.calibration_windows`)."""
        return calibration_windows(tokenizer, self.num_sequences, self.seq_len, self.source)

    def record(self) -> dict[str, Any]:
        """The provenance entry: {"use" (the label), "source" (described), "num_sequences", "seq_len"}."""
        return dict(
            use=self.label or self.use,
            source=describe_calibration_source(self.source),
            num_sequences=self.num_sequences,
            seq_len=self.seq_len,
        )


# Per backend: whether quantizing `recipe` calibrates static activation scales, and whether their windows are cut
# to the model's positions (quantkit's and ModelOpt's are; llm-compressor's job takes T as given).
LLMCOMPRESSOR_CALIBRATED_PRESETS = frozenset({"NVFP4"})  # FP8_BLOCK's activations are dynamic: no calibration pass
SCALE_CALIBRATION: dict[Backend, tuple[Callable[[Recipe], bool], bool]] = {
    Backend.QUANTKIT: (lambda recipe: recipe.static_activations, True),
    Backend.LLMCOMPRESSOR: (lambda recipe: recipe.scheme in LLMCOMPRESSOR_CALIBRATED_PRESETS, False),
    Backend.MODELOPT: (lambda recipe: True, True),  # ModelOpt calibrates every preset
}


def calibrates_scales(recipe: Recipe) -> bool:
    """Whether quantizing with `recipe` calibrates static activation scales (its backend's rule)."""
    return SCALE_CALIBRATION[recipe.backend][0](recipe)


def _cut(seq_len: int, max_positions: int | None) -> int:
    return min(seq_len, max_positions) if max_positions else seq_len


def calibration_windows_of(
    recipe: Recipe, max_positions: int | None = None, model_type: str | None = None
) -> tuple[Windows, ...]:
    """Every calibration set quantizing with `recipe` draws for a model of `model_type` with `max_positions`
    positions, in the order they are used: SmoothQuant's, GPTQ's, the static activation scales'; () for a recipe
    that calibrates nothing. A peer (llm-compressor) runs one dataset through every step that reads one (its AWQ,
    its GPTQ, its static scales): one set, named by those uses ("awq and gptq and activation scales"), GPTQ's
    windows when it runs, else `calibration`'s. (Rotation's check windows are no calibration: `QuantPlan.rotation`.)"""
    source = recipe.calibration_source(model_type)
    calibrates, cuts = SCALE_CALIBRATION[recipe.backend]
    if recipe.backend != Backend.QUANTKIT:
        known = PEER_MODIFIERS.get(recipe.backend, {})
        uses = [known[name].use for name, _ in recipe.peer_modifiers if known[name].calibrates]
        uses += ["gptq"] * (recipe.gptq is not None) + ["activation scales"] * calibrates(recipe)
        if not uses:
            return ()
        if recipe.gptq is not None:
            num_sequences, seq_len = recipe.gptq.num_sequences, _cut(recipe.gptq.seq_len, max_positions)
        else:
            cal = recipe.calibration or CalibrationSettings()
            num_sequences, seq_len = cal.num_sequences, _cut(cal.seq_len, max_positions) if cuts else cal.seq_len
        return (Windows(" and ".join(uses), num_sequences, seq_len, source),)
    sets = []
    if recipe.smoothquant is not None:
        sq = recipe.smoothquant  # the smoothing step's set is named by its rule: "smoothquant" or "awq"
        sets.append(Windows("smoothquant", sq.num_sequences, sq.seq_len, source, label=str(sq.scales)))
    if recipe.gptq is not None:
        sets.append(Windows("gptq", recipe.gptq.num_sequences, _cut(recipe.gptq.seq_len, max_positions), source))
    if calibrates(recipe):
        cal = recipe.calibration or CalibrationSettings()
        seq_len = _cut(cal.seq_len, max_positions) if cuts else cal.seq_len
        sets.append(Windows("activation scales", cal.num_sequences, seq_len, source))
    return tuple(sets)


@dataclass(frozen=True)
class RotationStep:
    """Rotate first (`quantkit.quantize.rotation`), checked on `check`'s windows."""

    settings: RotationSettings
    check: Windows


@dataclass(frozen=True)
class SmoothQuantStep:
    """SmoothQuant (or AWQ) folded into the float32 weights: `settings`' alpha and mappings, statistics on
    `windows`, each mapping's scales searched by `search` (None: the settings' alpha everywhere)."""

    settings: SmoothQuantSettings
    windows: Windows
    search: AlphaSearch | None


@dataclass(frozen=True)
class GPTQStep:
    """GPTQ rounding (`quantkit.quantize.gptq`) on `windows`' Hessians, after SmoothQuant's fold."""

    settings: GPTQSettings
    windows: Windows


_FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # one vLLM layer each


def served_unit(name: str) -> str:
    """The vLLM layer that serves matrix `name`: its routed-experts module for an expert matrix
    (`<experts>.<e>.<proj>`), `<parent>.q_proj+k_proj+v_proj` / `<parent>.gate_proj+up_proj` for a fused
    projection, else the name itself. The matrices of one unit share one scheme."""
    if expert := EXPERT_MATRIX.match(name):
        return expert.group("experts")
    parent, _, leaf = name.rpartition(".")
    fused = next((g for g in _FUSED_GROUPS if leaf in g), None)
    return f"{parent}.{'+'.join(fused)}" if fused else name


@dataclass(frozen=True)
class QuantPlan:
    """A recipe resolved against one model (module docstring). `scheme`: the recipe's scheme, None for bf16
    (nothing quantized); `matrices`: every quantizable matrix, in model order; `matrix_schemes`: each quantized
    matrix's scheme name; `weight_scales`: how the weights' decode scales are set (min-max or MSE-searched)."""

    recipe: Recipe
    scheme: Scheme | None
    matrices: tuple[str, ...]
    matrix_schemes: dict[str, str]
    rotation: RotationStep | None
    smoothquant: SmoothQuantStep | None
    gptq: GPTQStep | None
    static_scales: Windows | None
    weight_scales: WeightScales

    @classmethod
    def resolve(cls, recipe: Recipe, config: PretrainedConfig, matrices: list[str]) -> QuantPlan:
        """The plan of quantizing the model of `config`, whose quantizable matrices are `matrices`
        (`quantkit.quantize.output.quantizable_weights`' names), with quantkit's own `recipe`. ValueError: a bit
        budget not yet chosen on this source, a served layer split across schemes, SmoothQuant windows longer
        than the model's positions."""
        if recipe.backend != Backend.QUANTKIT:
            raise ValueError(f"recipe {recipe.name}: quantkit plans its own backend only, not {str(recipe.backend)!r}")
        if recipe.bit_budget is not None and recipe.bit_budget_choice is None:
            raise ValueError(
                f"recipe {recipe.name} has a bit budget: choose its schemes on this source first "
                "(quantkit.diagnose.budget.resolve_bit_budget; `quantkit quantize` and the study do)"
            )
        scheme = scheme_for(recipe.scheme)
        quantized = [n for n in matrices if not recipe.ignores(n)] if scheme is not None else []
        max_positions = getattr(config, "max_position_embeddings", None)
        windows = {w.use: w for w in calibration_windows_of(recipe, max_positions, config.model_type)}
        sq = recipe.smoothquant
        if sq is not None and max_positions and sq.seq_len > max_positions:
            raise ValueError(f"seq_len={sq.seq_len} exceeds the model's max_position_embeddings={max_positions}")
        rotation = None
        if recipe.rotation is not None:
            n, t = ROTATION_CHECK_WINDOWS
            check = Windows("rotation check", n, _cut(t, max_positions), recipe.calibration_source(config.model_type))
            rotation = RotationStep(recipe.rotation, check)
        plan = cls(
            recipe=recipe,
            scheme=scheme,
            matrices=tuple(matrices),
            matrix_schemes={n: recipe.scheme_of(n) for n in quantized},
            rotation=rotation,
            smoothquant=None
            if sq is None
            else SmoothQuantStep(
                sq,
                windows["smoothquant"],
                recipe.smoothing_search(
                    quantized_product(recipe, activations=not sq.search_weights_only), quantized_weight(recipe)
                ),
            ),
            gptq=None if recipe.gptq is None else GPTQStep(recipe.gptq, windows["gptq"]),
            static_scales=windows.get("activation scales"),
            weight_scales=recipe.weight_scales,
        )
        plan._check_one_scheme_per_served_layer()
        return plan

    @property
    def name(self) -> str:
        """The recipe's name."""
        return self.recipe.name

    @property
    def quantized(self) -> list[str]:
        """The matrices the plan encodes, in model order."""
        return list(self.matrix_schemes)

    @property
    def mse_scales(self) -> bool:
        """Whether each weight decode scale is searched for the least squared error (GPTQ: as it reaches a group)."""
        return self.weight_scales == WeightScales.MSE

    @property
    def ignored(self) -> list[str]:
        """The quantizable matrices left as the source holds them, in model order."""
        return [n for n in self.matrices if n not in self.matrix_schemes]

    def scheme_of(self, name: str) -> str | None:
        """Matrix `name`'s scheme name, None where it stays unquantized."""
        return self.matrix_schemes.get(name)

    @property
    def calibration_windows(self) -> tuple[Windows, ...]:
        """The calibration sets this plan draws, in the order of use (the provenance record's)."""
        steps = (self.smoothquant, self.gptq)
        return tuple(s.windows for s in steps if s is not None) + tuple(w for w in (self.static_scales,) if w)

    def quantization_config(self) -> dict:
        """The `quantization_config` entry of config.json (the scheme's keys: `quantkit.formats.schemes`)."""
        recipe, quantized = self.recipe, sorted(self.matrix_schemes)
        return {
            "quant_method": "quantkit",
            "recipe": recipe.name,
            # quantized plans only: the caller writes no quantization_config without a scheme
            **cast(Scheme, self.scheme).quantization_config(recipe.activation_scale),
            "quantized_modules": quantized,
            "ignored_modules": sorted(self.ignored),
            "smoothquant": None if self.smoothquant is None else vars(self.smoothquant.settings),
            "weight_scales": str(self.weight_scales),
            "module_schemes": {m: self.matrix_schemes[m] for m in quantized if self.matrix_schemes[m] != recipe.scheme},
            **({"bit_budget": recipe.bit_budget_choice} if recipe.bit_budget_choice is not None else {}),
        }

    def _check_one_scheme_per_served_layer(self) -> None:
        """Every experts module, and every q/k/v and gate/up group, in one scheme (ValueError naming the split)."""
        groups: dict[str, set[str]] = {}
        for name, scheme in self.matrix_schemes.items():
            groups.setdefault(served_unit(name), set()).add(scheme)
        if split := {k: sorted(v) for k, v in groups.items() if len(v) > 1}:
            first = next(iter(split))
            raise ValueError(
                f"recipe {self.recipe.name}: module_schemes gives {first} schemes {split[first]} ({len(split)} such "
                "groups); vLLM serves an experts module, q/k/v and gate/up as one layer each: give them one scheme"
            )
