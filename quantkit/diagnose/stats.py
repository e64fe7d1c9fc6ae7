"""Streaming statistics for diagnostics: memory independent of the number of calibration tokens.

- `Moments`: count, mean and central moments M2, M3, M4 of a stream of values (float64), merged batch by
  batch with Pebay's pairwise update (stable where raw power sums would cancel), plus the running max |x|.
  `kurtosis` is Pearson's (not excess): E[(x - mu)^4] / Var(x)^2, 3 for a Gaussian, large for heavy tails.
- `ChannelStats`: per channel (last dim) sum |x|, sum x^2 and max |x| over tokens.
The per-layer quantization SNR is `quantkit.metrics.snr_db`, as in `quantkit.quantize.quality`.
"""

from __future__ import annotations

import math

import torch


class Moments:
    """Running count, mean, central moments M2..M4 and max |x| of every element fed to `update`."""

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.m3 = 0.0
        self.m4 = 0.0
        self.max_abs = 0.0

    def update(self, x: torch.Tensor) -> None:
        """Add all elements of x (any shape) to the stream."""
        x = x.detach().reshape(-1).double()
        nb = x.numel()
        if nb == 0:
            return
        mb = x.mean().item()
        d = x - mb
        d2 = d * d
        m2b, m3b, m4b = d2.sum().item(), (d2 * d).sum().item(), (d2 * d2).sum().item()
        self.max_abs = max(self.max_abs, x.abs().max().item())
        na, n = self.n, self.n + nb
        delta = mb - self.mean
        m2a, m3a, m4a = self.m2, self.m3, self.m4
        self.m4 = (
            m4a
            + m4b
            + delta**4 * na * nb * (na * na - na * nb + nb * nb) / n**3
            + 6 * delta**2 * (na * na * m2b + nb * nb * m2a) / n**2
            + 4 * delta * (na * m3b - nb * m3a) / n
        )
        self.m3 = m3a + m3b + delta**3 * na * nb * (na - nb) / n**2 + 3 * delta * (na * m2b - nb * m2a) / n
        self.m2 = m2a + m2b + delta**2 * na * nb / n
        self.mean += delta * nb / n
        self.n = n

    @property
    def std(self) -> float:
        """Population standard deviation sqrt(M2 / n); NaN for an empty stream."""
        return math.sqrt(self.m2 / self.n) if self.n else float("nan")

    @property
    def kurtosis(self) -> float:
        """Pearson kurtosis n M4 / M2^2 (3 for a Gaussian); NaN for an empty or constant stream."""
        return self.n * self.m4 / self.m2**2 if self.n and self.m2 > 0 else float("nan")


class ChannelStats:
    """Per channel of the last dim: sum |x|, sum x^2, max |x| over all leading positions (float64 sums)."""

    def __init__(self, channels: int) -> None:
        self.count = 0
        self.sum_abs = torch.zeros(channels, dtype=torch.float64)
        self.sum_sq = torch.zeros(channels, dtype=torch.float64)
        self.max_abs = torch.zeros(channels, dtype=torch.float32)

    def update(self, x: torch.Tensor) -> None:
        """Add x (..., C): every leading position is one token of the per-channel sums and maxima."""
        x = x.detach().reshape(-1, x.shape[-1])
        a = x.abs()
        self.count += x.shape[0]
        self.sum_abs += a.sum(0, dtype=torch.float64)
        self.sum_sq += x.double().pow(2).sum(0)
        self.max_abs = torch.maximum(self.max_abs, a.amax(0).float())

    @property
    def mean_abs(self) -> torch.Tensor:
        """Mean |x| per channel, float64 (C,); zeros before any update."""
        return self.sum_abs / max(self.count, 1)

    @property
    def rms(self) -> torch.Tensor:
        """Root mean square per channel, float64 (C,); zeros before any update."""
        return (self.sum_sq / max(self.count, 1)).sqrt()
