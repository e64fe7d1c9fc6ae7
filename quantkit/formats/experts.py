"""Routed experts: one quantizable matrix per expert and projection, named as checkpoints name them.

transformers 5.x keeps a MoE layer's routed experts fused in one module (`Qwen3NextExperts`,
`Qwen2MoeExperts`, ...), as two 3-D parameters:

    gate_up_proj  (E, 2I, H)   rows [0, I) are expert e's gate_proj, rows [I, 2I) its up_proj
    down_proj     (E, H, I)    expert e computes down_e(act(gate_e x) * up_e x)

and converts them to per-expert tensors when it saves (its checkpoint conversion mapping "qwen2_moe",
which Qwen3-Next uses):

    <experts>.<e>.gate_proj.weight (I, H)   <experts>.<e>.up_proj.weight (I, H)   <experts>.<e>.down_proj.weight (H, I)

Those per-expert names are what vLLM's FusedMoE loader maps (`FusedMoE.make_expert_params_mapping`:
`experts.<e>.gate_proj.<suffix>` -> `w13_<suffix>` shard w1, `up_proj` -> `w13_<suffix>` shard w3,
`down_proj` -> `w2_<suffix>`), so quantkit checkpoints name every tensor of an expert matrix
`<experts>.<e>.<proj>.<suffix>` (suffixes: the scheme's, `quantkit.formats.schemes`), and list the
matrix `<experts>.<e>.<proj>` in quantization_config.quantized_modules like a Linear.

Detection is structural (any module with those two 3-D parameters), so subclasses of transformers'
expert modules are found without naming them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# "<experts>.<e>.<proj>": the name of one expert matrix (a quantized_modules entry)
EXPERT_MATRIX = re.compile(r"^(?P<experts>.+)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")
# a fused experts module's attribute, set by rotation (`quantkit.quantize.rotation`): the Hadamard block that
# transforms every down_proj input, act(gate) * up, online (its down_proj weights carry the inverse)
ONLINE_HADAMARD = "online_hadamard"


def is_fused_experts(module: nn.Module) -> bool:
    """Whether `module` holds routed experts fused as gate_up_proj (E, 2I, H) and down_proj (E, H, I)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return False
    if gate_up.dim() != 3 or down.dim() != 3:
        return False
    experts, two_i, hidden = gate_up.shape
    return two_i % 2 == 0 and tuple(down.shape) == (experts, hidden, two_i // 2)


def fused_experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> module of every fused routed-experts module in `model`."""
    return {name: m for name, m in model.named_modules() if is_fused_experts(m)}


def expert_matrices(name: str, module: nn.Module) -> dict[str, torch.Tensor]:
    """`<name>.<e>.<proj>` -> that expert matrix (a view of the fused parameter, (out, in)), e in 0..E-1."""
    gate_up_proj = cast(torch.Tensor, module.gate_up_proj)  # a fused experts module's (is_fused_experts)
    intermediate = gate_up_proj.shape[1] // 2
    out = {}
    for e in range(gate_up_proj.shape[0]):
        out[f"{name}.{e}.gate_proj"] = gate_up_proj[e, :intermediate]
        out[f"{name}.{e}.up_proj"] = gate_up_proj[e, intermediate:]
        out[f"{name}.{e}.down_proj"] = cast(torch.Tensor, module.down_proj)[e]
    return out


def fuse_expert_matrices(
    matrices: dict[str, torch.Tensor], name: str, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `expert_matrices`: per-expert matrices `<name>.<e>.<proj>` -> (gate_up_proj, down_proj).

    KeyError names the first missing matrix."""

    def get(e: int, proj: str) -> torch.Tensor:
        key = f"{name}.{e}.{proj}"
        if key not in matrices:
            raise KeyError(f"expert matrix {key} is missing")
        return matrices[key]

    gate_up = torch.stack([torch.cat([get(e, "gate_proj"), get(e, "up_proj")]) for e in range(num_experts)])
    down = torch.stack([get(e, "down_proj") for e in range(num_experts)])
    return gate_up, down


# A routed-experts activation quantizer: fake_quant(rows (S, K), segments, which) -> rows as the matmuls read them.
# rows are grouped by expert, `segments` lists (expert, start, stop) of each group in order; which = 0: the block
# input (gate/up), 1: down_proj's input.
Segments = list[tuple[int, int, int]]
RowsQuantizer = Callable[[torch.Tensor, Segments, int], torch.Tensor]
ExpertLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]  # (rows, weight, bias)
ExpertLinears = tuple[list[ExpertLinear], list[ExpertLinear]]  # per expert: gate_up's, down's


def per_expert(fake_quant: Callable[[torch.Tensor, int, int], torch.Tensor]) -> RowsQuantizer:
    """A `RowsQuantizer` from a per-expert one, fake_quant(rows, e, which): one call per segment."""

    def quantize(rows: torch.Tensor, segments: Segments, which: int) -> torch.Tensor:
        return torch.cat([fake_quant(rows[start:stop], e, which) for e, start, stop in segments])

    return quantize


def routed_experts_forward(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    fake_quant: RowsQuantizer,
    linears: ExpertLinears | None = None,
) -> torch.Tensor:
    """The routed experts of quantkit's MoE numerics, shared by the transformers reference (`FakeQuantExperts`) and
    vLLM's torch-emulation FusedMoE method, so the two compute the same thing by construction.

    x (T, H) any float dtype; top_k_index (T, k) expert ids (an id < 0 or >= E is skipped: not this rank's);
    top_k_weights (T, k); gate_up (E, 2I, H) and down (E, H, I) weights (rows [0, I) of gate_up are the gate).
    Per expert e hit by some token: y = down_e(fq(act(g) * u, e, 1)), [g; u] = gate_up_e(fq(x, e, 0)). The (token,
    slot) pairs are grouped by expert (stable: token order within an expert), and each input is quantized by ONE
    `fake_quant` call over all pairs' rows with their segments (`RowsQuantizer`; `per_expert` adapts a per-expert
    quantizer); the matmuls run per expert in the dtype it returns: float32 rows and decoded float32 weights for
    quantized experts, or the rows unchanged with weights of their dtype for unquantized ones. Returns float32
    (T, H) = sum over a token's experts, in expert order, of routing weight * y. `linears`: per expert e, the
    products `gate_up_e(rows, gate_up[e], None)` and `down_e(rows, down[e], None)` in place of F.linear (a second
    summation order's, `quantkit.serve.cpu.linear.ordered_expert_linears`); None: F.linear.
    """
    gate_up_linears, down_linears = linears or ([torch.nn.functional.linear] * gate_up.shape[0],) * 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    num_experts = gate_up.shape[0]
    token_idx, slot = ((top_k_index >= 0) & (top_k_index < num_experts)).nonzero(as_tuple=True)
    if token_idx.numel() == 0:
        return out
    experts, order = top_k_index[token_idx, slot].long().sort(stable=True)
    token_idx, slot = token_idx[order], slot[order]
    counts = torch.bincount(experts, minlength=num_experts).tolist()
    stops = torch.tensor(counts).cumsum(0).tolist()
    segments = [(e, stop - n, stop) for e, (n, stop) in enumerate(zip(counts, stops)) if n]
    xq = fake_quant(x[token_idx], segments, 0)
    h = [
        act_fn(gate) * up
        for gate, up in (
            gate_up_linears[e](xq[start:stop], gate_up[e], None).chunk(2, dim=-1) for e, start, stop in segments
        )
    ]
    hq = fake_quant(torch.cat(h), segments, 1)
    y = torch.cat([down_linears[e](hq[start:stop], down[e], None) for e, start, stop in segments])
    # index_put_, not index_add_: the latter's 2-thread CPU kernel took ~50 ms a call (vs 20 us) on a busy machine
    out.index_put_((token_idx,), y * top_k_weights[token_idx, slot, None].float(), accumulate=True)
    return out
