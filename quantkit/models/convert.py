"""Column remaps for checkpoints whose q_proj carries the attention output gate (Gated Attention).

quantkit stores the gate as its own projection `self_attn.g_proj` (rows: H for headwise, H*D for
elementwise, head-major). Public codebases fuse it into q_proj's output rows in one of two layouts
(H = query heads, K = KV heads, G = H / K heads per group, D = head_dim, g = 1 (headwise) or D):

- "interleaved" (Qwen3-Next, transformers' qwen3_next): per query head h, rows [q_h (D) | g_h (g)];
  the forward pass does `view(T, H, D + g)` and splits the last dim.
- "grouped" (qiuzh20/gated_attention): per KV head k, rows [q of its G heads (G*D) | their gates (G*g)];
  the forward pass does `view(T, K, G*D + G*g)` and splits the last dim.

`split_fused_q_gate` returns quantkit's (q_proj, g_proj) weights; `remap_fused_gates` converts a whole
state dict.
"""

from __future__ import annotations

import torch

FUSED_GATE_LAYOUTS = ("interleaved", "grouped")


def split_fused_q_gate(
    fused: torch.Tensor, layout: str, gate: str, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(H*(D+g), in) fused q_proj weight (or bias, 1-D) -> (q (H*D, in), g (H*g, in)) in quantkit's layout."""
    if layout not in FUSED_GATE_LAYOUTS:
        raise ValueError(f"unknown fused gate layout {layout!r}; expected one of {list(FUSED_GATE_LAYOUTS)}")
    if gate not in ("headwise", "elementwise"):
        raise ValueError(f"gate must be 'headwise' or 'elementwise', got {gate!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    g = 1 if gate == "headwise" else head_dim
    expected = num_heads * (head_dim + g)
    if fused.shape[0] != expected:
        raise ValueError(
            f"fused q_proj has {fused.shape[0]} output rows; a {gate} gate with H={num_heads}, D={head_dim} "
            f"needs H*(D+{g}) = {expected}"
        )
    rest = fused.shape[1:]
    if layout == "interleaved":
        per_head = fused.reshape(num_heads, head_dim + g, *rest)
        q, gates = per_head[:, :head_dim], per_head[:, head_dim:]
    else:
        group = num_heads // num_kv_heads
        per_kv = fused.reshape(num_kv_heads, group * (head_dim + g), *rest)
        q, gates = per_kv[:, : group * head_dim], per_kv[:, group * head_dim :]
    return q.reshape(num_heads * head_dim, *rest).clone(), gates.reshape(num_heads * g, *rest).clone()


def remap_fused_gates(
    state_dict: dict[str, torch.Tensor], layout: str, gate: str, num_heads: int, num_kv_heads: int, head_dim: int
) -> dict[str, torch.Tensor]:
    """Replace every `*.self_attn.q_proj.{weight,bias}` holding fused gates by q_proj + g_proj entries."""
    out = dict(state_dict)
    found = 0
    for name, tensor in state_dict.items():
        if ".self_attn.q_proj." in name:
            q, g = split_fused_q_gate(tensor, layout, gate, num_heads, num_kv_heads, head_dim)
            out[name] = q
            out[name.replace(".q_proj.", ".g_proj.")] = g
            found += 1
    if not found:
        raise ValueError("no '*.self_attn.q_proj.*' tensors found: is this a fused Gated Attention checkpoint?")
    return out
