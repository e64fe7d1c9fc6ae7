"""Row-wise max |x| of a 2-D tensor: the statistic behind every per-token activation scale.

`rowwise_absmax(x)` -> float32 tensor of shape (M,), amax_j |x[i, j]| over the last dimension, computed
in float32 (exact: max and abs do not round). Rows of any length; NaN propagates like torch.amax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _max_propagate_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _rowwise_absmax_kernel(x_ptr, out_ptr, n_cols, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
    tl.store(out_ptr + row, tl.reduce(acc, 0, _max_propagate_nan))


def rowwise_absmax_reference(x: torch.Tensor) -> torch.Tensor:
    """Pure-torch reference: (M, K) -> (M,) float32."""
    return x.float().abs().amax(dim=-1)


def rowwise_absmax(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Triton path: (M, K) -> (M,) float32; K may be any positive length (masked tail)."""
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"rowwise_absmax expects a non-empty 2-D tensor, got shape {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    _rowwise_absmax_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=block)
    return out
