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
