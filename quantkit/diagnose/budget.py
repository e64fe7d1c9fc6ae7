"""Formats per module under a bit budget (recipe key `bit_budget`, `quantkit quantize --avg-bits B`), chosen from
measured sensitivities; `resolve_bit_budget` runs before `quantize_checkpoint` (the CLI and the study call it).

A budget recipe names its lowest scheme (e.g. nvfp4) and an average: every layer vLLM serves as one GEMM (a
"unit": q/k/v together, gate/up together, a layer's routed experts together, any other Linear alone) gets the
recipe's scheme, fp8_block or bf16 (kept in the source precision), so that

    minimise  sum over units u of NSR_u(s_u)
    subject to  sum_u bits_u(s_u)  <=  avg_bits x (the units' weight elements)

NSR_u(s): the unit's output noise-to-signal power ratio when its weights and inputs are quantized with scheme s,
everything else exact: sum (y - y_q)^2 / sum y^2 of each matrix on held-out windows (the same figure as
`quantkit diagnose`'s quant SNR, 10^(-dB/10)), averaged over the unit's matrices; 0 for bf16. The model's inputs
to each layer are the unquantized model's (one unit's error does not reach the next one's measurement), so the
objective treats the units' errors as independent and additive: a proxy for the model's loss, not the loss.
bits_u(s): what the checkpoint stores for the unit's weights in s, codes and decode scales
(`Scheme.stored_bits`; bf16: 16 a weight). lm_head and the recipe's ignore list are outside the budget.

The problem is a multiple-choice knapsack, solved exactly by dynamic programming over the budget above the
all-lowest assignment in `GRANULES` steps, each unit's extra cost rounded up to whole steps: the chosen map never
exceeds the budget, and it is optimal for a budget at most (units x one step) smaller. Sensitivities are measured
with round-to-nearest quantization of the source (the recipe's weight scales and activation mode): SmoothQuant,
AWQ or GPTQ applied afterwards lower every NSR, the measured ranking is what the choice rests on.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoConfig

from quantkit.calibrate.layers import skeleton_model
from quantkit.diagnose.run import diagnose
from quantkit.formats.constants import WeightScales
from quantkit.formats.experts import EXPERT_MATRIX
from quantkit.formats.schemes import SCHEMES, UNQUANTIZED
from quantkit.quantize.output import quantizable_weights
from quantkit.quantize.plan import served_unit
from quantkit.quantize.recipe import Backend, Recipe

GRANULES = 4096  # steps of the budget above the all-lowest assignment (the DP's resolution)
HIGHER_SCHEMES = ("fp8_block", UNQUANTIZED)  # what a unit may move up to from the recipe's scheme
SOURCE_BITS = 16  # a weight kept unquantized, counted in bf16 (the deployment dtype)


def candidate_schemes(recipe: Recipe) -> tuple[str, ...]:
    """The schemes a unit may take, lowest first: the recipe's, then fp8_block and bf16."""
    return tuple(dict.fromkeys((recipe.scheme, *HIGHER_SCHEMES)))


def weight_bits(scheme: str, n: int, k: int) -> int:
    """Bits the checkpoint stores for an (n, k) weight in `scheme` (bf16: SOURCE_BITS a weight)."""
    return SOURCE_BITS * n * k if scheme == UNQUANTIZED else SCHEMES[scheme].stored_bits(n, k)


@dataclass(frozen=True)
class Unit:
    """One served layer: its matrices' names and (n, k) shapes, and per candidate scheme its NSR and stored bits."""

    name: str
    matrices: tuple[str, ...]
    elements: int  # weight elements
    nsr: Mapping[str, float]  # scheme -> mean noise-to-signal power ratio of its matrices (bf16: 0)
    bits: Mapping[str, int]  # scheme -> stored bits


def build_units(
    shapes: Mapping[str, tuple[int, int]], nsr: Mapping[str, Mapping[str, float]], schemes: Sequence[str]
) -> list[Unit]:
    """Units from the decided matrices' (n, k) shapes and each quantized scheme's {matrix: NSR}; a matrix the
    measurement did not reach (an expert no held-out token was routed to) counts 0."""
    members: dict[str, list[str]] = {}
    for name in shapes:
        members.setdefault(served_unit(name), []).append(name)
    units = []
    for unit, names in members.items():
        units.append(
            Unit(
                name=unit,
                matrices=tuple(names),
                elements=sum(shapes[m][0] * shapes[m][1] for m in names),
                nsr={
                    s: 0.0 if s == UNQUANTIZED else sum(nsr[s].get(m, 0.0) for m in names) / len(names) for s in schemes
                },
                bits={s: sum(weight_bits(s, *shapes[m]) for m in names) for s in schemes},
            )
        )
    return units


class BudgetError(ValueError):
    """The budget cannot be met or exceeds what the candidates need."""


def choose_schemes(units: Sequence[Unit], schemes: Sequence[str], avg_bits: float) -> dict[str, str]:
    """{unit: scheme} minimising the summed NSR with the stored bits <= avg_bits x the units' elements (exact
    multiple-choice knapsack on GRANULES steps; see the module docstring). BudgetError when even the lowest scheme
    everywhere exceeds the budget."""
    elements = sum(u.elements for u in units)
    lowest = sum(u.bits[schemes[0]] for u in units)
    room = avg_bits * elements - lowest
    if room < 0:
        raise BudgetError(
            f"--avg-bits {avg_bits:g} is below the lowest the candidates reach: {lowest / elements:.3f} bits a "
            f"weight with {schemes[0]} everywhere"
        )
    step = room / GRANULES if room > 0 else 1.0
    cost = np.array([[math.ceil((u.bits[s] - u.bits[schemes[0]]) / step) for s in schemes] for u in units])
    loss = np.array([[u.nsr[s] for s in schemes] for u in units])
    capacity = GRANULES if room > 0 else 0
    best = np.zeros(capacity + 1)  # best[c]: least summed NSR of the units so far within c steps
    picks = np.zeros((len(units), capacity + 1), dtype=np.int8)
    for i in range(len(units)):
        options = np.full((len(schemes), capacity + 1), np.inf)
        for j in range(len(schemes)):
            c = cost[i, j]
            if c <= capacity:
                options[j, c:] = best[: capacity + 1 - c] + loss[i, j]
        picks[i] = options.argmin(axis=0)  # ties: the lower scheme (fewer bits)
        best = options.min(axis=0)
    chosen, c = {}, capacity
    for i in reversed(range(len(units))):
        j = int(picks[i, c])
        chosen[units[i].name] = schemes[j]
        c -= int(cost[i, j])
    return {u.name: chosen[u.name] for u in units}


def budget_record(units: Sequence[Unit], choice: Mapping[str, str], avg_bits: float, windows: tuple[int, int]) -> dict:
    """What the checkpoint records of the choice (quantization_config.bit_budget): the asked and reached average,
    the windows the sensitivities were measured on, and per unit its scheme and NSR per candidate."""
    elements = sum(u.elements for u in units)
    stored = sum(u.bits[choice[u.name]] for u in units)
    return {
        "avg_bits": avg_bits,
        "achieved_avg_bits": round(stored / elements, 4),
        "elements": elements,
        "stored_bits": stored,
        "predicted_nsr_sum": float(f"{sum(u.nsr[choice[u.name]] for u in units):.6g}"),
        "sensitivity": {"metric": "output NSR, round to nearest", "num_sequences": windows[0], "seq_len": windows[1]},
        "units": {
            u.name: {"scheme": choice[u.name], "nsr": {s: float(f"{v:.6g}") for s, v in u.nsr.items()}} for u in units
        },
    }


def budget_table(record: Mapping[str, Any]) -> str:
    """The chosen map as printed: the average reached, how many units and weights each scheme got, then every unit
    above the lowest scheme with its NSRs."""
    units = record["units"]
    schemes = list(next(iter(units.values()))["nsr"]) if units else []
    lines = [
        f"bit budget: {record['avg_bits']:g} bits a weight asked, {record['achieved_avg_bits']:.3f} reached over "
        f"{record['elements'] / 1e6:.1f} M weights in {len(units)} served layers"
    ]
    for s in schemes:
        lines.append(f"  {s:>20}: {sum(u['scheme'] == s for u in units.values())} layers")
    raised = [(n, u) for n, u in units.items() if u["scheme"] != schemes[0]]
    if raised:
        lines.append(f"  above {schemes[0]} (NSR per candidate):")
        for name, u in raised:
            nsr = ", ".join(f"{s} {v:.3g}" for s, v in u["nsr"].items() if s != UNQUANTIZED)
            lines.append(f"    {name}: {u['scheme']} ({nsr})")
    return "\n".join(lines)


def _candidate_recipe(recipe: Recipe, scheme: str) -> Recipe:
    """The round-to-nearest recipe whose quantization error measures `scheme`'s sensitivity: `recipe`'s ignore list,
    weight scales and activation mode (where the scheme has one), nothing applied before it."""
    modes = SCHEMES[scheme].activation_scales
    return Recipe(
        name=f"{recipe.name}:{scheme}",
        scheme=scheme,
        activation_scale=recipe.activation_scale if recipe.activation_scale in modes else None,
        ignore=recipe.ignore,
        weight_scales=recipe.weight_scales
        if recipe.weight_scales in SCHEMES[scheme].weight_scales
        else WeightScales.MINMAX,
    )


def resolve_bit_budget(model_dir: str | Path, recipe: Recipe, progress: bool = True) -> Recipe:
    """`recipe` with its `bit_budget` resolved on the source in `model_dir`: the candidates' sensitivities measured
    layer by layer (`quantkit.diagnose`), the map chosen (`choose_schemes`) and printed, returned as exact-name
    `module_schemes` with the record in `bit_budget_choice`. A recipe without a budget comes back as it is."""
    budget = recipe.bit_budget
    if budget is None or recipe.bit_budget_choice is not None:
        return recipe
    if recipe.backend != Backend.QUANTKIT or recipe.scheme not in SCHEMES:
        raise BudgetError(f"recipe {recipe.name}: a bit budget needs one of quantkit's schemes {list(SCHEMES)}")
    schemes = candidate_schemes(recipe)
    config = AutoConfig.from_pretrained(model_dir)
    shapes = {
        n: (int(w.shape[0]), int(w.shape[1]))
        for n, w in quantizable_weights(skeleton_model(config)).items()
        if not recipe.ignores(n)
    }
    elements = sum(n * k for n, k in shapes.values())
    lowest = sum(weight_bits(schemes[0], *s) for s in shapes.values()) / elements
    if not lowest <= budget.avg_bits < SOURCE_BITS:  # before the measurement: the budget decides something
        raise BudgetError(
            f"recipe {recipe.name}: avg_bits {budget.avg_bits:g} must be at least {lowest:.3f} ({schemes[0]} "
            f"everywhere) and below {SOURCE_BITS} (everything unquantized)"
        )
    measured = [_candidate_recipe(recipe, s) for s in schemes if s != UNQUANTIZED]
    print(
        f"bit budget {budget.avg_bits:g}: measuring {len(shapes)} matrices' sensitivity to "
        f"{', '.join(r.scheme for r in measured)} on {budget.num_sequences} x {budget.seq_len} held-out tokens, "
        f"one decoder layer at a time (about the cost of `quantkit diagnose` with {len(measured)} recipes)",
        flush=True,
    )
    result = diagnose(model_dir, budget.num_sequences, budget.seq_len, recipes=measured, progress=progress)
    nsr = {
        r.scheme: {m: 0.0 if db is None else 10 ** (-db / 10) for m, db in result["quant_snr_db"][r.name].items()}
        for r in measured
    }
    units = build_units(shapes, nsr, schemes)
    choice = choose_schemes(units, schemes, budget.avg_bits)
    record = budget_record(
        units, choice, budget.avg_bits, (result["settings"]["num_sequences"], result["settings"]["seq_len"])
    )
    print(budget_table(record), flush=True)
    return replace(recipe, module_schemes=_module_schemes(units, choice, recipe.scheme), bit_budget_choice=record)


def _module_schemes(units: Sequence[Unit], choice: Mapping[str, str], lowest: str) -> tuple[tuple[str, str], ...]:
    """The choice as recipe `module_schemes` for every unit above `lowest`: its matrices by exact name, a
    routed-experts unit as one pattern over its experts (a model may have thousands of expert matrices)."""
    pairs = []
    for u in units:
        scheme = choice[u.name]
        if scheme == lowest:
            continue
        if all(EXPERT_MATRIX.match(m) for m in u.matrices):
            pairs.append((rf"re:{re.escape(u.name)}\.\d+\.(gate_proj|up_proj|down_proj)", scheme))
        else:
            pairs += [(m, scheme) for m in u.matrices]
    return tuple(pairs)
