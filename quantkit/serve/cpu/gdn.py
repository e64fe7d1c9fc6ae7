"""Batched prefill for vLLM's CPU Gated DeltaNet on CPUs without AVX-512 BF16: the causal conv1d and the delta rule.

vLLM 0.32's CPU Gated DeltaNet (`vllm.model_executor.layers.mamba.ops.cpu.gdn_attention`) runs its C++ conv kernels
only on AVX-512 BF16 / Arm BF16 CPUs; elsewhere (e.g. this project's AVX2 machine) the prefill conv is
`causal_conv1d_fn_cpu`: a Python loop over the sequences, each a depthwise `F.conv1d` in bfloat16, which PyTorch's
CPU backend runs as one small convolution per channel (the slowest part of a tiny hybrid's generate; figures:
benchmarks/README.md, "Measurements behind design choices"). `causal_conv1d_prefill` computes the same thing for all
sequences at once: each output is the float32 sum of its `width` taps (window gathered by index, the sequence's
cached state in front of it), rounded to the weight dtype once as `F.conv1d` does; the conv state of each sequence
is written as vLLM's function writes it (the last width - 1 inputs, its state in front of it).

The prefill delta rule there is vLLM's C++ `chunk_gated_delta_rule_cpu` (bf16 intermediates; most of a prefill,
same section); `chunk_gated_delta_rule_prefill` runs transformers' float32
chunked reference on the sequences padded into batches of similar length, rounding outputs and states to bf16 once.

`install()` (called by the plugin in every vLLM process) swaps both in where vLLM would use the slow paths; vLLM's
C++ conv path, where it runs (AVX-512 BF16 / Arm BF16), is left alone with its delta rule.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.serve.cpu.linear import cpu_lacks_bf16_matmul

PAD_SLOT_ID = -1  # vLLM's `vllm.v1.attention.backends.utils.PAD_SLOT_ID`: a padded request, no cache slot


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: str | bool | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
    **kwargs,
) -> torch.Tensor:
    """Depthwise causal conv over packed sequences; the signature and semantics of vLLM's `causal_conv1d_fn_cpu`.

    x (D, T): the T tokens of S sequences, sequence s in columns [query_start_loc[s], query_start_loc[s + 1]);
    weight (D, W); bias (D,) or None; conv_states (slots, D, >= W - 1): read (has_initial_state[s] True) and
    written at cache_indices[s] (default s), columns [0, W - 1); a sequence with no tokens or slot `pad_slot_id`
    leaves its slot alone. activation "silu"/"swish"/True applies SiLU after the conv. Returns (D, T) in x's dtype.
    """
    if isinstance(activation, bool):
        activation = "silu" if activation else None
    assert activation in (None, "silu", "swish"), activation  # vLLM's contract (its function asserts the same)
    out_dtype = x.dtype
    x = x.to(conv_states.dtype)
    dim, num_tokens = x.shape
    width = weight.shape[1]
    state_len = width - 1
    starts = query_start_loc[:-1].long()
    lengths = query_start_loc[1:].long() - starts
    num_seqs = lengths.numel()
    slots = cache_indices.long() if cache_indices is not None else torch.arange(num_seqs, device=x.device)
    initial = conv_states[slots][:, :, :state_len]  # (S, D, W - 1)
    if has_initial_state is None:
        initial = torch.zeros_like(initial)
    else:
        initial = torch.where(has_initial_state.bool()[:, None, None], initial, torch.zeros_like(initial))
    # source columns: the tokens, then each sequence's initial state; a sequence's extended position p (its state
    # at p < W - 1, then its tokens) is column `column(p, s)`
    source = torch.cat([x, initial.permute(1, 0, 2).reshape(dim, num_seqs * state_len)], dim=1).to(weight.dtype)

    def column(p: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        return torch.where(p < state_len, num_tokens + seq * state_len + p, starts[seq] + p - state_len)

    seq = torch.repeat_interleave(torch.arange(num_seqs, device=x.device), lengths)  # (T,)
    local = torch.arange(num_tokens, device=x.device) - starts[seq]
    w = weight.float()
    acc = torch.zeros((dim, num_tokens), dtype=torch.float32, device=x.device)
    for tap in range(width):  # output at local position i reads extended positions i .. i + W - 1
        acc += source[:, column(local + tap, seq)].float() * w[:, tap, None]
    if bias is not None:
        acc += bias.float()[:, None]
    out = acc.to(weight.dtype).to(x.dtype)
    if activation is not None:
        out = F.silu(out)
    keep = (lengths > 0) & (slots != pad_slot_id)
    if bool(keep.any()):
        kept = keep.nonzero().squeeze(1)
        tail = lengths[kept, None] + torch.arange(state_len, device=x.device)  # (S', W - 1)
        new_state = source[:, column(tail, kept[:, None])].permute(1, 0, 2)  # (S', D, W - 1)
        conv_states[slots[kept], :, :state_len] = new_state.to(conv_states.dtype)
    return out.to(out_dtype)


def length_groups(lengths: list[int], pad_budget: int) -> list[list[int]]:
    """Indices of the non-empty sequences grouped, longest first, so that each group padded to its longest sequence
    holds at most max(2 x its tokens, pad_budget) token slots: padding stays bounded when one long prompt meets many
    short ones."""
    groups: list[list[int]] = []
    tokens = 0
    for i in sorted((i for i in range(len(lengths)) if lengths[i] > 0), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max(2 * (tokens + lengths[i]), pad_budget):
            groups[-1].append(i)
            tokens += lengths[i]
        else:
            groups.append([i])
            tokens = lengths[i]
    return groups


def chunk_gated_delta_rule_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    output_final_state: bool,
    cu_seqlens: torch.Tensor,
    head_first: bool,
    use_qk_l2norm_in_kernel: bool,
    initial_state_indices: torch.Tensor,
    eps: float = 1e-5,
    pad_budget: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over packed sequences; the signature and semantics of vLLM's
    `chunk_gated_delta_rule_cpu` as its CPU Gated DeltaNet prefill calls it (head_first False).

    query, key (1, T, Hk, Dk); value (1, T, Hv, Dv); g (1, T, Hv): log decay; beta (1, T, Hv); sequence s spans
    tokens [cu_seqlens[s], cu_seqlens[s + 1]). initial_state (slots, Hv, Dk, Dv): sequence s starts from slot
    initial_state_indices[s] and its final state is written back there (in place; a `PAD_SLOT_ID` slot starts at
    zero and is not written). q and k are L2-normalized per head (x / sqrt(sum x^2 + eps)) when asked; Hv / Hk value
    heads share each key head, as Qwen3-Next's `repeat_interleave`. Sequences of similar length (`length_groups`)
    are padded into one batch (padding: g = 0, beta = 0, k = 0, which leaves a state unchanged) and run through
    transformers' float32 reference `torch_chunk_gated_delta_rule` (chunks of 64). Returns ((1, T, Hv, Dv) in
    query's dtype, the (S, Hv, Dk, Dv) float32 final states).
    """
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    assert not head_first, "vLLM's CPU prefill passes head_first=False"
    q, k, v = query[0].float(), key[0].float(), value[0].float()
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    groups = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    gate, strength = g[0].float(), beta[0].float()
    starts, lengths = cu_seqlens[:-1].tolist(), (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    slots = initial_state_indices.long()
    real = slots != PAD_SLOT_ID
    out = torch.zeros_like(v)
    final = torch.zeros((len(lengths), *initial_state.shape[1:]), dtype=torch.float32)
    final[real] = initial_state[slots[real]].float()  # an empty sequence ends where it starts
    for group in length_groups(lengths, pad_budget):
        tokens = torch.cat([torch.arange(starts[i], starts[i] + lengths[i]) for i in group])
        seq = torch.repeat_interleave(torch.arange(len(group)), torch.tensor([lengths[i] for i in group]))
        pos = tokens - torch.tensor([starts[i] for i in group])[seq]

        def batched(
            x: torch.Tensor,
            group: list[int] = group,
            seq=seq,
            pos=pos,
            tokens=tokens,  # this group's, bound now
        ) -> torch.Tensor:
            padded = x.new_zeros((len(group), lengths[group[0]], *x.shape[1:]))
            padded[seq, pos] = x[tokens]
            return padded

        members = torch.tensor(group)
        o, last = torch_chunk_gated_delta_rule(
            batched(q),
            batched(k),
            batched(v),
            batched(gate),
            batched(strength),
            initial_state=final[members],
            output_final_state=True,
            use_qk_l2norm_in_kernel=False,
        )
        out[tokens] = o[seq, pos]
        final[members] = last
        written = real[members]
        initial_state[slots[members][written]] = last[written].to(initial_state.dtype)
    return out.to(query.dtype).unsqueeze(0), final


def install() -> bool:
    """Make vLLM's CPU Gated DeltaNet use `causal_conv1d_prefill` and `chunk_gated_delta_rule_prefill` for its
    prefill where it would use its per-sequence torch conv (no AVX-512 BF16 / Arm BF16); True if swapped in
    (idempotent)."""
    if not cpu_lacks_bf16_matmul():
        return False  # vLLM's C++ conv runs there (or a GPU)
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    gdn_attention.causal_conv1d_torch = causal_conv1d_prefill
    gdn_attention.ops.chunk_gated_delta_rule_cpu = chunk_gated_delta_rule_prefill
    return True
