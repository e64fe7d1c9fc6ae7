"""A batched prefill causal conv1d for vLLM's CPU Gated DeltaNet on CPUs without AVX-512 BF16.

vLLM 0.32's CPU Gated DeltaNet (`vllm.model_executor.layers.mamba.ops.cpu.gdn_attention`) runs its C++ conv kernels
only on AVX-512 BF16 / Arm BF16 CPUs; elsewhere (e.g. this project's AVX2 machine) the prefill conv is
`causal_conv1d_fn_cpu`: a Python loop over the sequences, each a depthwise `F.conv1d` in bfloat16, which PyTorch's
CPU backend runs as one small convolution per channel (measured: ~200 ms per sequence and layer for 512 channels,
2 cores, 2026-11-23; 54% of a tiny hybrid's generate time). `causal_conv1d_prefill` computes the same thing for all
sequences at once: each output is the float32 sum of its `width` taps (window gathered by index, the sequence's
cached state in front of it), rounded to the weight dtype once as `F.conv1d` does; the conv state of each sequence
is written as vLLM's function writes it (the last width - 1 inputs, its state in front of it).

`install()` (called by the plugin in every vLLM process) swaps it in where vLLM would use the slow function; vLLM's
C++ path, where it runs, is left alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    initial = conv_states[slots][:, :, :state_len]                               # (S, D, W - 1)
    if has_initial_state is None:
        initial = torch.zeros_like(initial)
    else:
        initial = torch.where(has_initial_state.bool()[:, None, None], initial, torch.zeros_like(initial))
    # source columns: the tokens, then each sequence's initial state; a sequence's extended position p (its state
    # at p < W - 1, then its tokens) is column `column(p, s)`
    source = torch.cat([x, initial.permute(1, 0, 2).reshape(dim, num_seqs * state_len)], dim=1).to(weight.dtype)

    def column(p: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        return torch.where(p < state_len, num_tokens + seq * state_len + p, starts[seq] + p - state_len)

    seq = torch.repeat_interleave(torch.arange(num_seqs, device=x.device), lengths)   # (T,)
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
        tail = lengths[kept, None] + torch.arange(state_len, device=x.device)          # (S', W - 1)
        new_state = source[:, column(tail, kept[:, None])].permute(1, 0, 2)           # (S', D, W - 1)
        conv_states[slots[kept], :, :state_len] = new_state.to(conv_states.dtype)
    return out.to(out_dtype)


def install() -> bool:
    """Make vLLM's CPU Gated DeltaNet use `causal_conv1d_prefill` for its prefill conv where it would use its
    per-sequence torch fallback (no AVX-512 BF16 / Arm BF16); True if swapped in (idempotent)."""
    if torch.cuda.is_available():
        return False
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    if torch.cpu._is_avx512_bf16_supported() or gdn_attention.is_arm_bf16():
        return False  # vLLM's C++ conv runs there
    gdn_attention.causal_conv1d_torch = causal_conv1d_prefill
    return True
