"""Fused Gated Attention checkpoints remap to quantkit's separate g_proj exactly.

Each case builds a fused q_proj, runs the fused codebase's own forward split on a projection, and
checks that quantkit's q_proj / g_proj give the same queries and gates per head, bit for bit.
"""

import pytest
import torch

from quantkit.models.convert import remap_fused_gates, split_fused_q_gate

H, K, D, IN, T = 8, 2, 4, 16, 3


def _reference_split(y: torch.Tensor, layout: str, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused codebases' forward: projection output (T, H*(D+g)) -> q (T, H, D), gates (T, H, g)."""
    if layout == "interleaved":  # transformers qwen3_next: chunk(view(T, H, 2D), 2) for g = D
        per_head = y.view(T, H, D + g)
        return per_head[..., :D], per_head[..., D:]
    group = H // K  # qiuzh20/gated_attention: per KV head [q of the group | gates of the group]
    per_kv = y.view(T, K, group * (D + g))
    return per_kv[..., : group * D].reshape(T, H, D), per_kv[..., group * D :].reshape(T, H, g)


@pytest.mark.parametrize("layout", ["interleaved", "grouped"])
@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_split_matches_the_fused_forward(layout, gate):
    g = 1 if gate == "headwise" else D
    fused = torch.randn(H * (D + g), IN)
    x = torch.randn(T, IN)
    q_ref, g_ref = _reference_split(x @ fused.T, layout, g)
    q_w, g_w = split_fused_q_gate(fused, layout, gate, H, K, D)
    assert torch.equal((x @ q_w.T).view(T, H, D), q_ref)
    assert torch.equal((x @ g_w.T).view(T, H, g), g_ref)


def test_state_dict_remap_and_errors():
    fused = torch.randn(H * (D + 1), IN)
    sd = {"model.layers.0.self_attn.q_proj.weight": fused, "model.layers.0.self_attn.k_proj.weight": torch.randn(K * D, IN)}
    out = remap_fused_gates(sd, "grouped", "headwise", H, K, D)
    assert out["model.layers.0.self_attn.q_proj.weight"].shape == (H * D, IN)
    assert out["model.layers.0.self_attn.g_proj.weight"].shape == (H, IN)
    assert torch.equal(out["model.layers.0.self_attn.k_proj.weight"], sd["model.layers.0.self_attn.k_proj.weight"])
    with pytest.raises(ValueError, match="needs H\\*\\(D\\+4\\)"):
        split_fused_q_gate(fused, "interleaved", "elementwise", H, K, D)
    with pytest.raises(ValueError, match="unknown fused gate layout"):
        split_fused_q_gate(fused, "rowwise", "headwise", H, K, D)
    with pytest.raises(ValueError, match="no '\\*.self_attn.q_proj"):
        remap_fused_gates({"lm_head.weight": fused}, "grouped", "headwise", H, K, D)
