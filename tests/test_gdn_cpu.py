"""quantkit's CPU Gated DeltaNet prefill (`quantkit.serve.cpu.gdn`) against vLLM's own functions, on packed sequences
of every kind vLLM sends: the batched conv against `causal_conv1d_fn_cpu` (what it replaces), the chunked delta rule
against float64 truth and vLLM's C++ `chunk_gated_delta_rule_cpu` (test_delta_rule_*, tolerances derived there).

Conv tolerance: none for the conv states (both copy the same inputs) nor for the outputs: both form each output as the
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
import torch.nn.functional as F

from quantkit.serve.cpu.gdn import PAD_SLOT_ID, causal_conv1d_prefill, chunk_gated_delta_rule_prefill, length_groups

pytestmark = pytest.mark.cpu_isa  # run again with AVX2 kernels forced on AVX-512 CPUs (Makefile `test`)

causal_conv1d = pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d")

LENGTHS = [5, 1, 0, 2, 37, 3]  # a 1-token prompt, an empty entry, one shorter than the state
SLOTS = [3, 7, 1, -1, 0, 9]  # -1: vLLM's PAD_SLOT_ID (no cache slot: state left alone)
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


DELTA_LENGTHS = [5, 1, 130, 2, 64, 0, 65, 3]  # one token; several 64-token chunks; one chunk; empty
DELTA_SLOTS = [3, 7, 1, 0, 9, 8, 4, PAD_SLOT_ID]  # the last: a padded request (no slot: starts at zero)
DELTA_HAS_STATE = [True, False, True, True, False, True, True, False]
HK, HV, DK, DV = 2, 4, 64, 64  # the tiny hybrid's heads: 2 value heads per key head


def delta_rule_inputs():
    g = torch.Generator().manual_seed(0)
    tokens = sum(DELTA_LENGTHS)
    cu = torch.tensor([0, *torch.tensor(DELTA_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    q, k = (torch.randn(1, tokens, HK, DK, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(1, tokens, HV, DV, generator=g).bfloat16()
    # decay and write strength as vLLM's prefill makes them: g = -exp(A_log) softplus(a + dt_bias) (float32),
    # beta = sigmoid(b) (bf16)
    a_log, dt_bias = torch.randn(HV, generator=g), torch.randn(HV, generator=g)
    gate = -a_log.exp() * F.softplus(torch.randn(1, tokens, HV, generator=g) + dt_bias)
    beta = torch.sigmoid(torch.randn(1, tokens, HV, generator=g)).bfloat16()
    state = (torch.randn(10, HV, DK, DV, generator=g) * 0.1).bfloat16()
    for slot, has in zip(DELTA_SLOTS, DELTA_HAS_STATE):
        if not has and slot != PAD_SLOT_ID:
            state[slot] = 0  # vLLM's prefill zeroes the slots of new prompts before the kernel
    return q, k, v, gate, beta, state, cu, torch.tensor(DELTA_SLOTS, dtype=torch.int32)


def exact_delta_rule(q, k, v, gate, beta, state, cu):
    """Float64 truth per sequence: the recurrence itself, token by token (not the chunked algorithm under test):
    S <- exp(g) S; S <- S + beta k (v - S^T k)^T; o = S^T q / sqrt(Dk), with q, k L2-normalized (eps 1e-5)."""
    qd, kd, vd = q[0].double(), k[0].double(), v[0].double()
    qd = qd * torch.rsqrt((qd * qd).sum(-1, keepdim=True) + 1e-5) / DK**0.5
    kd = kd * torch.rsqrt((kd * kd).sum(-1, keepdim=True) + 1e-5)
    qd, kd = qd.repeat_interleave(HV // HK, 1), kd.repeat_interleave(HV // HK, 1)
    out, states = torch.zeros(vd.shape, dtype=torch.float64), state.double().clone()
    for s, slot in enumerate(DELTA_SLOTS):
        S = states[slot].clone() if slot != PAD_SLOT_ID else torch.zeros(HV, DK, DV, dtype=torch.float64)
        for t in range(int(cu[s]), int(cu[s + 1])):
            S = S * gate[0, t].double().exp()[:, None, None]
            delta = vd[t] - torch.einsum("hkv,hk->hv", S, kd[t])
            S = S + beta[0, t].double()[:, None, None] * torch.einsum("hk,hv->hkv", kd[t], delta)
            out[t] = torch.einsum("hkv,hk->hv", S, qd[t])
        if slot != PAD_SLOT_ID:
            states[slot] = S
    return out, states


@pytest.mark.parametrize("pad_budget", [4096, 1])  # one padded batch; groups of similar length (4 here)
def test_delta_rule_is_correctly_rounded(pad_budget):
    """Against float64 truth: quantkit computes in float32 and rounds outputs and states to bf16 once, so each is
    within half a bf16 step of the truth (<= 2^-8 of its magnitude) plus float32 error: per 64-token chunk ~(64 + 2 x
    64) accumulations of terms bounded by the state / value scale M, 2^-24 each, over <= 3 chunks: < 600 x 2^-24 M,
    allowed as 2^-14 M. Slots of no sequence (and the padded request's) are left bit-identical."""
    q, k, v, gate, beta, state, cu, slots = delta_rule_inputs()
    ours_state = state.clone()
    out, _ = chunk_gated_delta_rule_prefill(
        q, k, v, gate, beta, ours_state, True, cu, False, True, slots, pad_budget=pad_budget
    )
    exact_out, exact_states = exact_delta_rule(q, k, v, gate, beta, state, cu)
    scale = max(float(v.abs().max()), float(exact_states.abs().max()))
    assert ((out[0].double() - exact_out).abs() <= 2**-8 * exact_out.abs() + 2**-14 * scale).all()
    written = [s for s, n in zip(DELTA_SLOTS, DELTA_LENGTHS) if s != PAD_SLOT_ID and n > 0]
    got, want = ours_state[written].double(), exact_states[written]
    assert ((got - want).abs() <= 2**-8 * want.abs() + 2**-14 * scale).all()
    untouched = [s for s in range(state.shape[0]) if s not in written]
    assert torch.equal(ours_state[untouched], state[untouched])


@pytest.mark.vllm_cpu
def test_delta_rule_agrees_with_vllm_kernel():
    """Against vLLM's C++ kernel (what the plugin replaces on CPUs without AVX-512 BF16), same call: that kernel keeps
    bf16 intermediates (measured: 2.6x quantkit's distance to the truth, which is one output rounding), each chunk
    step adding at most a bf16 rounding (2^-8 relative) to the state that the outputs read: over <= 3 chunks plus
    the output rounding, under 2^-5 of the output / state scale. A semantic slip (head mapping, slot, decay or l2norm
    convention) moves outputs by the scale itself."""
    if not hasattr(torch.ops._C, "chunk_gated_delta_rule_cpu"):
        pytest.skip("vLLM's CPU kernels are not in this vLLM build (a CUDA wheel)")
    q, k, v, gate, beta, state, cu, slots = delta_rule_inputs()
    keep = [i for i, s in enumerate(DELTA_SLOTS) if s != PAD_SLOT_ID]  # vLLM's kernel takes real slots only
    tokens = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in keep])
    sub_cu = torch.tensor([0, *torch.tensor([DELTA_LENGTHS[i] for i in keep]).cumsum(0).tolist()], dtype=torch.int32)
    args = (q[:, tokens], k[:, tokens], v[:, tokens], gate[:, tokens], beta[:, tokens])
    vllm_state, ours_state = state.clone(), state.clone()
    want, _ = torch.ops._C.chunk_gated_delta_rule_cpu(*args, vllm_state, True, sub_cu, False, True, slots[keep], 1e-5)
    got, _ = chunk_gated_delta_rule_prefill(*args, ours_state, True, sub_cu, False, True, slots[keep])
    assert ((got.float() - want.float()).abs() <= 2**-5 * float(want.abs().max())).all()
    assert ((ours_state.float() - vllm_state.float()).abs() <= 2**-5 * float(vllm_state.abs().max())).all()
    assert not torch.equal(ours_state, state)


def test_length_groups_bound_the_padding():
    lengths = [4000, 1, 1, 3, 0, 700, 650, 20, 18, 2]
    for budget in (1, 64, 4096):
        groups = length_groups(lengths, budget)
        assert sorted(i for g in groups for i in g) == [i for i, n in enumerate(lengths) if n > 0]
        for group in groups:
            tokens = sum(lengths[i] for i in group)
            assert len(group) * max(lengths[i] for i in group) <= max(2 * tokens, budget)
    assert not {1, 2, 3, 7, 8, 9} & set(length_groups(lengths, 1)[0])  # the short ones are not padded to 4000
