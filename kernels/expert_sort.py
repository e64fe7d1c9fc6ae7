"""Tokens sorted by expert for the grouped (MoE) GEMMs, and the way back (pure torch, no host sync).

`sort_by_expert(topk_ids (T, k), num_experts)` -> `ExpertSort`: the T * k (token, slot) pairs, stably sorted by
expert id, as S = T * k "sorted rows":

    token_index (S,) int32     the token (row of the layer input x) of sorted row s
    flat_index (S,) int64      its pair's index into topk_ids.flatten(): token * k + slot
    expert_offsets (E + 1,) int32   rows [offsets[e], offsets[e + 1]) go to expert e; offsets[0] = 0

An id outside [0, E) (an expert of another expert-parallel rank) sorts after every valid one: rows from
offsets[E] on belong to no expert, the grouped GEMMs write them as zeros and `combine_expert_rows` skips
them. vLLM's ``moe_align_block_size`` does this job and also pads each expert to whole tiles; here the
GEMMs map tiles to experts themselves (`quantkit.kernels.grouped_gemm.expert_tiles`), so nothing is padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertSort:
    """The (token, slot) pairs of a routing decision sorted by expert (shapes in the module docstring)."""

    token_index: torch.Tensor
    flat_index: torch.Tensor
    expert_offsets: torch.Tensor


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertSort:
    """topk_ids (T, k) integer expert ids -> the pairs sorted by expert, stably (tokens in order within one)."""
    if topk_ids.ndim != 2 or topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(
            f"sort_by_expert: topk_ids must be a 2-D integer tensor (T, k), got {topk_ids.dtype} "
            f"{tuple(topk_ids.shape)}"
        )
    if num_experts < 1:
        raise ValueError(f"sort_by_expert: num_experts must be >= 1, got {num_experts}")
    ids = topk_ids.reshape(-1).to(torch.int64)
    key = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    sorted_key, order = torch.sort(key, stable=True)
    experts = torch.arange(num_experts + 1, device=ids.device)
    offsets = torch.searchsorted(sorted_key, experts)  # first sorted row of expert e (of "none" for e = E)
    return ExpertSort(
        token_index=(order // topk_ids.shape[1]).to(torch.int32),
        flat_index=order,
        expert_offsets=offsets.to(torch.int32),
    )


def combine_expert_rows(y_sorted: torch.Tensor, sort: ExpertSort, topk_weights: torch.Tensor) -> torch.Tensor:
    """y_sorted (S, N), the experts' outputs in sorted order -> float32 (T, N): each token's sum over its
    slots of topk_weights[token, slot] * y (rows of no expert, from offsets[E] on, add nothing)."""
    tokens, top_k = topk_weights.shape
    if y_sorted.ndim != 2 or y_sorted.shape[0] != tokens * top_k or sort.flat_index.shape != (tokens * top_k,):
        raise ValueError(
            f"combine_expert_rows: y_sorted must be (T * k, N) = ({tokens * top_k}, N) for topk_weights "
            f"{tuple(topk_weights.shape)}, got {tuple(y_sorted.shape)}"
        )
    valid = torch.arange(y_sorted.shape[0], device=y_sorted.device) < sort.expert_offsets[-1]
    weight = topk_weights.reshape(-1)[sort.flat_index].float()
    rows = torch.where(valid[:, None], y_sorted.float() * weight[:, None], 0.0)  # whatever those rows hold
    out = torch.zeros(tokens, y_sorted.shape[1], dtype=torch.float32, device=y_sorted.device)
    return out.index_add_(0, sort.token_index, rows)
