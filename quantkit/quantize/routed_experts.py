"""Routed experts seen one expert at a time: what each expert matrix reads and writes on the routed tokens.

transformers' fused expert modules (`quantkit.formats.experts`: gate_up_proj (E, 2I, H), down_proj (E, H, I),
`act_fn`) take (hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) from the MoE block, the router's
top-k. A forward hook on that module gets both, and `routed_expert_passes` recomputes expert e on the tokens
routed to it, as the module does:

    x_e = hidden_states[tokens with e in their top-k]        input of gate_proj and up_proj   (n_e, H)
    [g, u] = x_e [gate_e; up_e]^T,  h_e = act(g) * u          input of down_proj                (n_e, I)
    y_e = h_e down_e^T                                        expert output, before the routing weight

(a rotated module, `quantkit.quantize.rotation`: h_e = (act(g) * u) (I (x) H_b), its `ONLINE_HADAMARD` block.)

Used by `quantkit quality` (per-expert SNR) and `quantkit diagnose` (per-expert load, input maxima and SNR; it
sits above quantize in the import order of docs/architecture.md, so the shared code lives here).
Expert matrices are named as checkpoints name them, `<experts>.<e>.<proj>`; `summarize_expert_snr` condenses
the per-matrix SNR of a model to one line per experts module and projection (min / median over experts).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from quantkit.formats.experts import EXPERT_MATRIX, EXPERT_PROJECTIONS, ONLINE_HADAMARD
from quantkit.formats.hadamard import block_hadamard

EXPERTS_ARGUMENTS = ("hidden_states", "top_k_index", "top_k_weights")  # transformers' fused experts' forward


def experts_call(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden_states, top_k_index, top_k_weights) of a call of a fused experts module, as a forward hook registered
    with_kwargs=True receives it (each argument positional or by keyword)."""
    hidden, index, weights = (*args, *(kwargs[k] for k in EXPERTS_ARGUMENTS[len(args) :]))[:3]
    return hidden, index, weights


@dataclass
class ExpertPass:
    """Expert `expert` on its routed tokens (n of the block's T flattened tokens); float tensors."""

    expert: int
    token_idx: torch.Tensor  # (n,) rows of hidden_states routed to the expert
    slot: torch.Tensor  # (n,) which of the token's k choices it was
    x: torch.Tensor  # (n, H) input of gate_proj and up_proj
    gate_up: torch.Tensor  # (n, 2I) outputs of gate_proj (columns [0, I)) and up_proj ([I, 2I))
    h: torch.Tensor  # (n, I) act(gate) * up (a rotated module: online-transformed), input of down_proj
    y: torch.Tensor  # (n, H) output of down_proj (before the routing weight)


def routed_expert_passes(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor
) -> Iterator[ExpertPass]:
    """Each expert with at least one routed token, in expert order (`module`: a fused experts module)."""
    x_all = hidden_states.detach().reshape(-1, hidden_states.shape[-1])
    block = getattr(module, ONLINE_HADAMARD, None)
    index = top_k_index.reshape(x_all.shape[0], -1)
    for e in range(cast(torch.Tensor, module.gate_up_proj).shape[0]):
        token_idx, slot = torch.where(index == e)
        if token_idx.numel() == 0:
            continue
        x = x_all[token_idx]
        gate_up = nn.functional.linear(x, cast(torch.Tensor, module.gate_up_proj)[e].detach())
        gate, up = gate_up.chunk(2, dim=-1)
        h = cast(Callable[[torch.Tensor], torch.Tensor], module.act_fn)(gate) * up
        if block is not None:
            h = block_hadamard(h, block).to(h.dtype)
        y = nn.functional.linear(h, cast(torch.Tensor, module.down_proj)[e].detach())
        yield ExpertPass(e, token_idx, slot, x, gate_up, h, y)


def projection_outputs(p: ExpertPass) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """proj -> (its input, its output) for gate_proj, up_proj, down_proj of one expert pass."""
    gate, up = p.gate_up.chunk(2, dim=-1)
    return {"gate_proj": (p.x, gate), "up_proj": (p.x, up), "down_proj": (p.h, p.y)}


def summarize_expert_snr(snr_db: Mapping[str, float | None]) -> dict[str, dict[str, dict]]:
    """Per-matrix SNR (dB) -> {experts module: {proj: {"min", "median", "min_expert", "experts"}}}.

    Only names `<experts>.<e>.<proj>` are read; None (exact or undefined) values are left out of min and
    median; `experts` counts the matrices with a value. Median of an even count: the mean of the middle two.
    """
    groups: dict[str, dict[str, dict[int, float]]] = {}
    for name, value in snr_db.items():
        match = EXPERT_MATRIX.match(name)
        if match is None or value is None or not math.isfinite(value):
            continue
        groups.setdefault(match["experts"], {}).setdefault(match["proj"], {})[int(match["expert"])] = value
    out: dict[str, dict[str, dict]] = {}
    for experts, by_proj in sorted(groups.items()):
        out[experts] = {}
        for proj in (p for p in EXPERT_PROJECTIONS if p in by_proj):
            values = by_proj[proj]
            ranked = sorted(values.values())
            mid = len(ranked) // 2
            median = ranked[mid] if len(ranked) % 2 else (ranked[mid - 1] + ranked[mid]) / 2
            out[experts][proj] = {
                "min": ranked[0],
                "median": median,
                "min_expert": min(values, key=values.__getitem__),
                "experts": len(values),
            }
    return out
