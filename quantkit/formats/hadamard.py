"""Hadamard transforms for rotation (QuaRot, Ashkboos et al. 2024): the residual rotation's orthogonal matrix and
the online block Hadamard that a rotated checkpoint applies to a down_proj's input before quantizing it.

Conventions: activations are row vectors x (..., K); a Linear computes y = x W^T with W (N, K). H_b is the
Sylvester Hadamard matrix of order b (a power of two) scaled by 1/sqrt(b): symmetric and orthogonal, H_b H_b = I.
The online transform of a K-wide input with block b (b | K) is x -> x (I_{K/b} (x) H_b): each run of b
consecutive channels mixed by H_b, so under tensor parallelism a rank holding a multiple of b columns transforms
its slice alone. Its weight side is W -> W (I (x) H_b) (the same transform on W's rows, H_b being symmetric):
x W^T = (x H)(W H)^T.
"""

from __future__ import annotations

import math

import torch

MAX_ONLINE_BLOCK = 4096  # the largest block the online transform uses (its cost: log2(b) passes over x)


def online_block(k: int) -> int:
    """The online Hadamard block of a K-wide input: the largest power of two dividing K, at most
    MAX_ONLINE_BLOCK (K = 1536 -> 512, 4864 -> 256, 4096 -> 4096)."""
    if k <= 0:
        raise ValueError(f"online Hadamard: input width must be positive, got {k}")
    return min(k & -k, MAX_ONLINE_BLOCK)


def hadamard_scale(block: int) -> float:
    """1/sqrt(block): the butterfly's final scale (a Python float; torch and Triton multiply float32 by it rounded
    to float32, so the reference and the fused quantizers use the same number)."""
    return 1.0 / math.sqrt(block)


def check_online_block(block: int, k: int) -> None:
    """ValueError unless `block` is a power of two dividing the input width k."""
    if not isinstance(block, int) or block <= 0 or block & (block - 1) or k % block:
        raise ValueError(f"online Hadamard: block {block!r} must be a power of two dividing the input width {k}")


def block_hadamard(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (..., K) -> x (I_{K/block} (x) H_block), float32 (computed in float32 from x's values): the fast
    Walsh-Hadamard transform, log2(block) butterfly passes, then the 1/sqrt(block) scale. block: a power of two
    dividing K. The reference and every served path call this function, so they agree bit for bit."""
    k = x.shape[-1]
    check_online_block(block, k)
    lead = x.shape[:-1]
    y = x.float().reshape(-1, k // block, block)
    h = 1
    while h < block:
        pairs = y.view(y.shape[0], k // block, block // (2 * h), 2, h)
        a, b = pairs[:, :, :, 0], pairs[:, :, :, 1]
        y = torch.stack((a + b, a - b), dim=3).reshape(y.shape)
        h *= 2
    return (y * hadamard_scale(block)).reshape(*lead, k)


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """H_n (n, n), a power-of-two order, scaled to be orthogonal (Sylvester's construction)."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two order, got {n}")
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(n)


def residual_rotation(hidden: int, seed: int, block: int | None = None) -> torch.Tensor:
    """The residual stream's rotation Q (hidden, hidden), float64, orthogonal.

    block None (QuaRot): diag(signs) (H_{2^a} (x) O_m) for hidden = 2^a m (m odd), signs random +-1 and O_m a random
    orthogonal matrix (QR of a Gaussian, the sign of R's diagonal fixed), both from `seed`. m = 1 is QuaRot's
    randomized Hadamard; every entry has magnitude |O_m[i, j]| / sqrt(2^a), so Q mixes every channel into every
    other (an outlier channel is spread over all).
    block b (a power of two dividing hidden; MR-GPTQ, arXiv 2509.23202): diag(signs) (I_{hidden/b} (x) H_b), a
    randomized Hadamard within each run of b channels: with b the quantization group's size (16 for NVFP4) an
    outlier is spread over its own group only, whose scale already pays for it, instead of into every group."""
    generator = torch.Generator().manual_seed(seed)
    if block is not None:
        if block < 2 or block & (block - 1) or hidden % block:
            raise ValueError(f"a residual rotation block must be a power of two >= 2 dividing {hidden}, got {block}")
        signs = torch.randint(0, 2, (hidden,), generator=generator).to(torch.float64) * 2 - 1
        return signs[:, None] * torch.block_diag(*[hadamard_matrix(block)] * (hidden // block))
    power = hidden & -hidden
    odd = hidden // power
    gaussian = torch.randn(odd, odd, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    orthogonal = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()))
    signs = torch.randint(0, 2, (hidden,), generator=generator).to(torch.float64) * 2 - 1
    return signs[:, None] * torch.kron(hadamard_matrix(power), orthogonal.contiguous())
