"""quantkit's batched prefill conv for vLLM's CPU Gated DeltaNet (`quantkit.serve.gdn_cpu`) against vLLM's own
per-sequence function (`causal_conv1d_fn_cpu`, what it replaces), on packed sequences of every kind vLLM sends.

Tolerance: none for the conv states (both copy the same inputs) nor for the outputs: both form each output as the
width-4 sum of bf16 products in float32 -- products of two bf16 numbers are exact in float32 (8 + 8 significant
bits < 24) -- and round once to bf16; the float32 sum of 4 exact terms plus a bias may differ in its last float32
bit between summation orders, which moves the bf16 result only when it lies within 2**-24 relative of a bf16
rounding midpoint (probability ~2**-16 per element, ~0.05 expected of the 2,944 outputs here). The assertion
therefore allows at most 4 outputs to differ, each by one bf16 step (2**-7 relative); a wrong tap, state or
sequence boundary changes most outputs of a sequence by far more.
"""

from __future__ import annotations

import pytest
import torch

from quantkit.serve.gdn_cpu import causal_conv1d_prefill

causal_conv1d = pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d")

LENGTHS = [5, 1, 0, 2, 37, 3]                       # a 1-token prompt, an empty entry, one shorter than the state
SLOTS = [3, 7, 1, -1, 0, 9]                         # -1: vLLM's PAD_SLOT_ID (no cache slot: state left alone)
HAS_STATE = [True, False, True, True, False, True]  # a resumed chunk reads its slot's state, a new prompt zeros


@pytest.mark.parametrize("with_bias", [False, True])
def test_prefill_conv_equals_vllm(with_bias):
    g = torch.Generator().manual_seed(0)
    dim, width = 64, 4
    query_start_loc = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(dim, int(query_start_loc[-1]), generator=g).bfloat16()
    weight = (torch.randn(dim, width, generator=g) * 0.5).bfloat16()
    bias = torch.randn(dim, generator=g).bfloat16() if with_bias else None
    states = torch.randn(10, width - 1, dim, generator=g).bfloat16()  # vLLM's (slots, state_len, dim) layout
    args = (query_start_loc, torch.tensor(SLOTS, dtype=torch.int32), torch.tensor(HAS_STATE), "silu")
    vllm_states, ours_states = states.clone(), states.clone()
    want = causal_conv1d.causal_conv1d_fn_cpu(x, weight, bias, vllm_states.transpose(-1, -2), *args)
    got = causal_conv1d_prefill(x, weight, bias, ours_states.transpose(-1, -2), *args)

    assert torch.equal(ours_states, vllm_states)
    assert not torch.equal(ours_states, states)  # the states were written
    padded = slice(int(query_start_loc[3]), int(query_start_loc[4]))  # vLLM leaves the pad request's outputs unset
    keep = torch.ones(x.shape[1], dtype=torch.bool)
    keep[padded] = False
    diff = (got.float() - want.float())[:, keep].abs()
    assert int((diff > 0).sum()) <= 4
    assert bool((diff <= want.float()[:, keep].abs() * 2.0**-7).all())

