"""SmoothQuant's calibration statistics kept between quantizations of one source checkpoint.

SmoothQuant's statistics -- the per-channel maxima max |x_j| at the inputs of each mapping's consumers, gathered
on the unsmoothed model layer by layer (`quantkit.calibrate.smoothquant.layer_factors`) -- depend on the source
weights, the calibration windows, the early stop and which inputs are observed, and on nothing the recipe's format
decides. A study's W8A8+SQ and W4A4+SQ rows of one model (and a recipe rerun after a change to its format or
GPTQ settings) therefore read the same maxima: the second quantization takes them from this cache instead of
streaming every window through every layer again (on Qwen2.5-Coder-0.5B, 256 x 512 windows early-stopped: 269 s
-> 41 s on 2 CPU cores). The factors, folds, reports and the function-preservation check are
computed as without the cache, so the checkpoint's bytes are the same either way (tests/test_stats_cache.py).

Layout: `<root>/<key>/layer-<i>.safetensors`, one file per decoder layer (its maxima, float32, under the consumer
names; metadata "windows" and "last_change"), written into a temporary directory that becomes `<key>/` only when
every layer is in (`quantkit.atomic.atomic_dir`): a killed calibration leaves no entry. The key is a SHA-256 of
what determines the maxima: the source checkpoint (config.json's bytes; each weight file's name, size and
modification time), the calibration token windows, the early-stop rule, the batch size, each layer's observed
consumers, and the torch version. Not cached: recipes that search alpha (the search needs the sampled rows too)
or rotate (the statistics are of the rotated model). A cache entry that cannot be read is ignored with a warning
and recomputed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from quantkit.atomic import atomic_dir
from quantkit.calibrate.stats import EarlyStop

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when the stored layout or what the maxima mean changes


@dataclass
class LayerStatistics:
    """One decoder layer's SmoothQuant statistics: `maxima` consumer name -> max |x| per input channel (float32,
    1-D), the windows they saw and the last batch's largest relative L2 change (`stats.Settling`)."""

    maxima: dict[str, torch.Tensor]
    windows: int
    last_change: float


def source_fingerprint(model_dir: Path) -> dict[str, object]:
    """What identifies a checkpoint directory's weights without reading them: config.json's SHA-256 and each
    *.safetensors file's name, size and modification time (ns)."""
    files = sorted(model_dir.glob("*.safetensors"))
    return {
        "config": hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest(),
        "weights": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
    }


@dataclass(frozen=True)
class CacheLocation:
    """Where a quantization of the checkpoint in `model_dir` keeps its SmoothQuant statistics: under `root`."""

    root: Path
    model_dir: Path

    def entry(
        self,
        tokens: torch.Tensor,
        consumers: Sequence[Sequence[str]],
        early_stop: EarlyStop | None,
        batch_size: int,
    ) -> StatisticsCache:
        """The entry for statistics on `tokens` (N, T) int64, observing `consumers[i]` in decoder layer i, with
        `early_stop` and batches of `batch_size` windows."""
        what = {
            "format": CACHE_FORMAT,
            "torch": torch.__version__,
            "source": source_fingerprint(Path(self.model_dir)),
            "tokens": [list(tokens.shape), hashlib.sha256(tokens.to(torch.int64).numpy().tobytes()).hexdigest()],
            "early_stop": None if early_stop is None else asdict(early_stop),
            "batch_size": batch_size,
            "consumers": [list(c) for c in consumers],
        }
        key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]
        return StatisticsCache(Path(self.root) / key)


class StatisticsCache:
    """One calibration's entry (a directory, see the module docstring)."""

    def __init__(self, entry: Path) -> None:
        self.entry = entry

    def load(self, num_layers: int, device: torch.device | str = "cpu") -> list[LayerStatistics] | None:
        """Every layer's statistics (maxima on `device`) when the entry is complete and readable, else None (a
        broken entry is logged)."""
        if not self.entry.is_dir():
            return None
        layers = []
        try:
            for i in range(num_layers):
                path = self.entry / f"layer-{i}.safetensors"
                with safe_open(str(path), "pt") as f:
                    meta = f.metadata() or {}
                    maxima = {name: f.get_tensor(name).to(device) for name in f.keys()}
                layers.append(LayerStatistics(maxima, int(meta["windows"]), float(meta["last_change"])))
        except (OSError, KeyError, ValueError, SafetensorError) as err:
            logger.warning("SmoothQuant statistics cache %s unreadable (%s): calibrating again", self.entry, err)
            return None
        logger.info("SmoothQuant statistics: reused from %s (%d layers)", self.entry, num_layers)
        return layers

    @contextlib.contextmanager
    def recording(self) -> Iterator[LayerRecorder]:
        """A recorder whose layers become the entry when the block exits normally (nothing on an exception)."""
        with atomic_dir(self.entry, overwrite=True) as tmp:
            yield LayerRecorder(tmp)
        logger.info("SmoothQuant statistics: kept in %s", self.entry)


class LayerRecorder:
    """Writes one layer's statistics at a time into an entry being built (`StatisticsCache.recording`)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def save(self, i: int, statistics: LayerStatistics) -> None:
        """Write decoder layer i's statistics."""
        save_file(
            {n: m.detach().float().contiguous().cpu() for n, m in statistics.maxima.items()},
            str(self.directory / f"layer-{i}.safetensors"),
            metadata={"windows": str(statistics.windows), "last_change": repr(statistics.last_change)},
        )


@contextlib.contextmanager
def reuse_or_record(
    cache: StatisticsCache | None, num_layers: int, device: torch.device | str = "cpu"
) -> Iterator[tuple[list[LayerStatistics] | None, LayerRecorder | None]]:
    """(every layer's cached statistics, None) when `cache` holds them; else (None, a recorder whose layers become
    the entry when the block exits normally), or (None, None) without a cache."""
    cached = None if cache is None else cache.load(num_layers, device)
    if cache is None or cached is not None:
        yield cached, None
        return
    with cache.recording() as recorder:
        yield None, recorder
