"""SmoothQuant (Xiao et al. 2023), the calibration step before FP8 / NVFP4 in paper 000 App. A.4.2.

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

X_j: channel j at the consumers' input over the calibration set (`layer_factors`, one decoder layer at a
time, on the streaming engine of `quantkit.calibrate.layers`); W_j: column j of
all consumers stacked (max over every consuming linear). The smoothing layer's output channel j is
divided by s_j and the consumers' column j multiplied by s_j (`mappings.fold_output`): the model computes
the same function, which is checked, not assumed — logits on held-out text before and after must agree
within `tolerance`, or the folds are undone and FunctionPreservationError is raised.

Clamping: a channel whose max|X_j| or max|W_j| is 0 (dead, or a zero weight column) gets s_j = 1 — there
is nothing to migrate and the formula would give 0 or inf; every other s_j is clamped to
[SCALE_MIN, SCALE_MAX] = [1e-4, 1e4], which keeps folded parameters finite in bf16/fp16 (and is far
outside what real checkpoints need). All factors are computed from the unsmoothed weights and a single
calibration pass, then folded: no fold changes another mapping's activation statistics, and the only
weight two mappings share (up_proj: columns for post_attention_layernorm, rows for up->down) is read
along different axes.

MoE layers (docs/smoothquant-moe.md): the factor of a MoE layer's post_attention_layernorm is one vector
shared by every reader of that norm, so X_j is the max over ALL tokens of the MoE block's input (taken at
the router's and the fused experts module's input, which see every token whatever the routing: the
statistics cover every expert, unlike per-expert hooks that see only routed tokens), and W_j the max over
every expert's gate/up columns and the shared expert's (the router and shared-expert gate are folded but
not counted: they stay unquantized).

    from quantkit.calibrate import smooth_model
    report = smooth_model(model, None, tokenizer, alpha=0.5, num_sequences=256, seq_len=512)
    print(report.summary())
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol, cast

import torch
from torch import nn
from tqdm import tqdm

from quantkit.calibrate.alpha_search import (
    AWQ_GRID,
    AlphaSearch,
    ParentSampler,
    RowSampler,
    Rule,
    awq_factors,
    choose_scales,
    choose_scales_by_parent,
    parent_of,
    weight_mean,
)
from quantkit.calibrate.layers import (
    BATCH_SIZE,
    HEAD_POSITIONS,
    LayerwiseError,
    Stream,
    advance_stream,
    decoder_stack,
    embed_stream,
    final_hidden,
    head_logits,
)
from quantkit.calibrate.mappings import (
    MappingPlan,
    SmoothMapping,
    SmoothQuantMappingError,
    fold_output,
    input_weight,
    resolve_mappings,
    scale_,
)
from quantkit.calibrate.stats import DEFAULT_NUM_SEQUENCES, DEFAULT_SEQ_LEN, ChannelMaxObserver, EarlyStop, Settling
from quantkit.calibrate.stats_cache import CacheLocation, LayerStatistics, StatisticsCache, reuse_or_record
from quantkit.data import calibration_windows, default_calibration_source
from quantkit.errors import NonFiniteStatisticsError, QuantkitError

logger = logging.getLogger(__name__)

DEFAULT_ALPHA = 0.5
SCALE_MIN, SCALE_MAX = 1e-4, 1e4
# max |logit change| / max |logit| allowed after folding. In float32 the fold changes only rounding (~1e-5
# relative on the tiny test models). In bf16/fp16 every folded weight is re-rounded to 8/11 mantissa bits,
# which moves logits by ~1-2% on random tiny models (more with injected outliers: they are chaotic): the
# default there only catches gross mapping errors. Power-of-two factors make the fold exact in any dtype.
DEFAULT_TOLERANCE = 1e-3
LOW_PRECISION_TOLERANCE = 5e-2
DEFAULT_VERIFY_SEQUENCES = 4


class FunctionPreservationError(QuantkitError, RuntimeError):
    """Smoothing changed the model's logits beyond the tolerance (the folds have been undone)."""


@dataclass
class MappingReport:
    """What smoothing did to one mapping. Activation maxima after are max_j(max|X_j| / s_j) (exact by the
    fold's construction); weight maxima after are measured on the folded consumers."""

    name: str
    kind: str
    smooth: str
    consumers: tuple[str, ...]
    channels: int
    alpha: float  # the migration strength of this mapping's factors (searched or the recipe's)
    scale_min: float
    scale_median: float
    scale_max: float
    act_max_before: float
    act_max_after: float
    weight_max_before: float
    weight_max_after: float


@dataclass
class SmoothQuantReport:
    architecture: str
    alpha: float
    num_sequences: int
    seq_len: int
    mappings: list[MappingReport]
    skipped: list[str]
    max_logit_change: float
    logit_scale: float
    relative_logit_change: float
    tolerance: float
    windows_drawn: int = 0  # calibration windows drawn; num_sequences: the windows every layer saw
    early_stop: float | None = None  # EarlyStop.tolerance, None: every window drawn was used
    windows_per_layer: list[int] = field(default_factory=list)
    last_change: list[float] = field(default_factory=list)  # per layer: the last batch's relative L2 change
    scales: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # smoothing layer -> s (float32)
    alpha_grid: list[float] | None = None  # the searched alphas (`alpha_search`); None: `alpha` everywhere
    alpha_errors: dict[str, list[float]] = field(default_factory=dict)  # searched mapping -> error per grid alpha

    def to_dict(self) -> dict:
        """JSON-serializable (scales summarized per mapping, tensors left out)."""
        out = asdict(self)
        out.pop("scales")
        return out

    def summary(self) -> str:
        """A Markdown table: one row per mapping, then the function-preservation check."""
        rows = [
            "| mapping | alpha | channels | s min / median / max | max|X| before -> after | max|W| before -> after |",
            "|---|---|---|---|---|---|",
        ]
        rows += [
            f"| {m.name} | {m.alpha:g} | {m.channels} | {m.scale_min:.3g} / {m.scale_median:.3g} / {m.scale_max:.3g} | "
            f"{m.act_max_before:.4g} -> {m.act_max_after:.4g} | {m.weight_max_before:.4g} -> {m.weight_max_after:.4g} |"
            for m in self.mappings
        ]
        rows.append("")
        used = (
            f"{self.num_sequences} x {self.seq_len} tokens"
            if self.num_sequences == self.windows_drawn
            else f"{self.num_sequences} of {self.windows_drawn} windows x {self.seq_len} tokens (early stop at "
            f"{self.early_stop:g}: the first layer's maxima settled)"
        )
        rows.append(
            f"{self.architecture}, alpha={self.alpha if self.alpha_grid is None else 'searched per mapping'}, {used}; "
            f"max |logit change| {self.max_logit_change:.3g} (logit scale {self.logit_scale:.3g}, relative "
            f"{self.relative_logit_change:.3g} <= tolerance {self.tolerance:.3g})"
        )
        rows += [f"skipped: {s}" for s in self.skipped]
        return "\n".join(rows)


def smoothing_factors(
    act_max: torch.Tensor,
    weight_max: torch.Tensor,
    alpha: float = DEFAULT_ALPHA,
    power_of_two: bool = False,
) -> torch.Tensor:
    """s_j = act_max_j^alpha / weight_max_j^(1-alpha) in float32; s_j = 1 where either max is 0, else clamped
    to [SCALE_MIN, SCALE_MAX]. power_of_two rounds s_j to the nearest power of two (in log space): folding
    then changes only exponents, so it is bit-exact in any dtype, at factors within sqrt(2) of the formula."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
    x, w = act_max.float(), weight_max.float()
    s = x.pow(alpha) / w.pow(1.0 - alpha)
    s = s.clamp(SCALE_MIN, SCALE_MAX)
    if power_of_two:
        s = torch.exp2(torch.log2(s).round())
    return torch.where((x > 0) & (w > 0), s, torch.ones_like(s))


def _to_smoothing_channels(mapping: SmoothMapping, per_input: torch.Tensor, channels: int) -> torch.Tensor:
    """Reduce a per-consumer-input-channel maximum to the smoothing layer's channels (max over a GQA group)."""
    idx = mapping.channel_index(per_input.numel(), per_input.device)
    out = torch.zeros(channels, dtype=per_input.dtype, device=per_input.device)
    return out.scatter_reduce(0, idx, per_input, "amax", include_self=False)


def _smoothing_channels(model: nn.Module, mapping: SmoothMapping) -> int:
    smooth = model.get_submodule(mapping.smooth)
    return smooth.out_features if isinstance(smooth, nn.Linear) else cast(torch.Tensor, smooth.weight).numel()


def _weight_col_max(model: nn.Module, mapping: SmoothMapping) -> torch.Tensor:
    """max |W_j| over the quantized consumers' input columns (fold_only consumers stay unquantized: left out)."""
    weights = [input_weight(model.get_submodule(c)).detach() for c in mapping.consumers if c not in mapping.fold_only]
    return torch.stack([w.abs().reshape(-1, w.shape[-1]).amax(0).float() for w in weights]).amax(0)


def mapping_report(
    model: nn.Module,
    mapping: SmoothMapping,
    scale: torch.Tensor,
    act_max: torch.Tensor,
    weight_max: torch.Tensor,
    alpha: float,
) -> MappingReport:
    """The report of one folded mapping: `scale` (channels,) its smoothing scale, `act_max` / `weight_max`
    (channels,) the activation and consumer-weight maxima before the fold, `alpha` its migration strength;
    `model` holds the folded weights."""
    w_after = _to_smoothing_channels(mapping, _weight_col_max(model, mapping).to(act_max.device), len(scale))
    return MappingReport(
        name=mapping.name,
        kind=mapping.kind,
        smooth=mapping.smooth,
        consumers=mapping.consumers,
        channels=len(scale),
        alpha=alpha,
        scale_min=scale.min().item(),
        scale_median=scale.median().item(),
        scale_max=scale.max().item(),
        act_max_before=act_max.max().item(),
        act_max_after=(act_max / scale).max().item(),
        weight_max_before=weight_max.max().item(),
        weight_max_after=w_after.max().item(),
    )


@torch.no_grad()
def fold_mapping(model: nn.Module, mapping: SmoothMapping, s: torch.Tensor) -> None:
    """Divide the smoothing layer's channel j (and its `extra_divide` copies) by s_j; multiply consumers' columns."""
    fold_output(model.get_submodule(mapping.smooth), s)
    for name in mapping.extra_divide:
        param = model.get_parameter(name)
        scale_(param, (1.0 / s).view(param.shape))
    for name in mapping.consumers:
        weight = input_weight(model.get_submodule(name))  # input channels on the last dimension
        scale_(weight, s[mapping.channel_index(weight.shape[-1], s.device)])


def _check_finite(plan: MappingPlan, maxima: dict[str, torch.Tensor]) -> None:
    bad = []
    for m in plan.mappings:
        for c in m.consumers:
            x = maxima[c]
            if not torch.isfinite(x).all():
                kinds = ("NaN" if torch.isnan(x).any() else "") + ("Inf" if torch.isinf(x).any() else "")
                bad.append(f"{c} ({kinds} in {int((~torch.isfinite(x)).sum())} channels; mapping {m.name})")
    if bad:
        raise NonFiniteStatisticsError(
            "SmoothQuant: non-finite activation statistics at the input of "
            + "; ".join(bad[:8])
            + (f"; and {len(bad) - 8} more" if len(bad) > 8 else "")
            + ". The model produces NaN/Inf on the calibration data (check the checkpoint and dtype)."
        )


def _check_shared_input(plan: MappingPlan, maxima: dict[str, torch.Tensor]) -> None:
    """Consumers of one mapping must read the same tensor; differing statistics mean the mapping is wrong."""
    for m in plan.mappings:
        first = maxima[m.consumers[0]]
        for c in m.consumers[1:]:
            if not torch.equal(maxima[c], first):
                raise SmoothQuantMappingError(
                    f"SmoothQuant mapping {m.name}: {c} and {m.consumers[0]} do not read the same input "
                    "(their activation statistics differ); the mapping does not fit this model"
                )


def calibration_tokens(
    calibration,
    tokenizer,
    num_sequences: int | None,
    seq_len: int | None,
    max_positions: int | None,
    model_type: str | None = None,
) -> torch.Tensor:
    """(N, T) int64 calibration tokens from a source (a string: `quantkit.data` calibration source; None: the
    model's default, `default_calibration_source(model_type)`), a list of texts, a token tensor, or an iterable
    of token batches. Text is cut into num_sequences (default 4096) windows of seq_len (default
    min(512, max_positions)); token input is used as given (num_sequences keeps the first N)."""
    if calibration is None:
        calibration = default_calibration_source(model_type)
    if isinstance(calibration, str) or (
        isinstance(calibration, Sequence) and calibration and isinstance(calibration[0], str)
    ):
        if tokenizer is None:
            raise ValueError("calibration from text needs a tokenizer")
        seq_len = seq_len or (min(DEFAULT_SEQ_LEN, max_positions) if max_positions else DEFAULT_SEQ_LEN)
        if max_positions and seq_len > max_positions:
            raise ValueError(f"seq_len={seq_len} exceeds the model's max_position_embeddings={max_positions}")
        return calibration_windows(tokenizer, num_sequences or DEFAULT_NUM_SEQUENCES, seq_len, calibration)
    if isinstance(calibration, torch.Tensor):
        tokens = calibration
    elif isinstance(calibration, Iterable):
        batches = [torch.as_tensor(b) for b in calibration]
        batches = [b[None] if b.dim() == 1 else b for b in batches]
        if not batches or len({b.shape[1] for b in batches}) != 1:
            raise ValueError(
                f"token batches must be non-empty and of one length, got shapes {[tuple(b.shape) for b in batches]}"
            )
        tokens = torch.cat(batches)
    else:
        raise TypeError(
            "calibration must be None, a source string, a list of texts, a token tensor or token batches; "
            f"got {type(calibration).__name__}"
        )
    if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32) or len(tokens) == 0:
        raise ValueError(
            f"calibration tokens must be a non-empty (N, T) integer tensor, got {tuple(tokens.shape)} {tokens.dtype}"
        )
    if seq_len is not None and tokens.shape[1] != seq_len:
        raise ValueError(f"calibration tokens have length {tokens.shape[1]}, but seq_len={seq_len} was asked")
    if num_sequences is not None:
        if len(tokens) < num_sequences:
            raise ValueError(f"num_sequences={num_sequences} asked, but only {len(tokens)} token sequences were given")
        tokens = tokens[:num_sequences]
    return tokens.long()


def layer_mappings(plan: MappingPlan, stack_name: str, num_layers: int) -> list[tuple[SmoothMapping, ...]]:
    """The plan's mappings per decoder layer (`<stack_name>.<i>.` prefixes); SmoothQuantMappingError for a
    mapping outside every layer (the engine calibrates one layer at a time)."""
    per_layer: list[list[SmoothMapping]] = [[] for _ in range(num_layers)]
    for m in plan.mappings:
        head, _, rest = m.smooth.partition(f"{stack_name}.")
        index = rest.split(".", 1)[0]
        if head or not index.isdigit() or int(index) >= num_layers:
            raise SmoothQuantMappingError(
                f"SmoothQuant mapping {m.name}: {m.smooth} is outside the decoder layers "
                f"{stack_name}.*, which the layer-by-layer calibration cannot reach"
            )
        per_layer[int(index)].append(m)
    return [tuple(ms) for ms in per_layer]


@dataclass
class LayerFactors:
    """One decoder layer's SmoothQuant calibration: per mapping (mapping, s, max|X| and max|W| per smoothing
    channel before the fold), and the statistics they came from (`stats_cache.LayerStatistics`)."""

    factors: list[tuple[SmoothMapping, torch.Tensor, torch.Tensor, torch.Tensor]]
    statistics: LayerStatistics  # the maxima the factors came from (observed, or `stats_cache`'s)
    alphas: dict[str, float]  # mapping name -> the alpha its factors were computed with
    alpha_errors: dict[str, list[float]] = field(default_factory=dict)  # searched mappings: error per grid alpha
    reports: list[MappingReport] = field(default_factory=list)  # filled by `fold_layer`

    @property
    def windows(self) -> int:
        """Calibration windows the layer's statistics saw."""
        return self.statistics.windows

    @property
    def last_change(self) -> float:
        """The last batch's largest relative L2 change of a maxima vector."""
        return self.statistics.last_change


def fold_layer(model: nn.Module, calibrated: LayerFactors) -> None:
    """Fold one layer's factors into `model` and record each mapping's report (it reads the folded weights)."""
    for m, s, _, _ in calibrated.factors:
        fold_mapping(model, m, s)
    calibrated.reports = [
        mapping_report(model, m, s, x, w, calibrated.alphas[m.name]) for m, s, x, w in calibrated.factors
    ]


@torch.no_grad()
def layer_factors(
    model: nn.Module,
    layer: nn.Module,
    i: int,
    stream: Stream | None,
    mappings: Sequence[SmoothMapping],
    alpha: float,
    power_of_two: bool = False,
    early_stop: EarlyStop | None = None,
    search: AlphaSearch | None = None,
    statistics: LayerStatistics | None = None,
) -> LayerFactors:
    """Carry `stream` through decoder layer i (unsmoothed) while observing the per-channel maxima at the inputs of
    `mappings`' consumers, and compute each mapping's factors (`smoothing_factors`). With `early_stop` the
    stream ends at the batch where the maxima settled (for every later layer too). With `search`, each mapping
    whose quantized consumers are all Linear modules gets the alpha of least quantized output error
    (`quantkit.calibrate.alpha_search`), the others `alpha`. With `statistics` (this layer's, from
    `quantkit.calibrate.stats_cache`; not with `search`) nothing is observed and `stream` is not touched.
    Nothing is folded here.
    Raises NonFiniteStatisticsError, SmoothQuantMappingError (consumers of one mapping read different inputs)."""
    consumers = [c for m in mappings for c in m.consumers]
    searched = [m for m in mappings if search is not None and _searchable(model, m)]
    rows: dict[str, torch.Tensor] = {}
    means: dict[str, torch.Tensor] = {}
    parents = {m.name: parent_of(_quantized_consumers(m)) for m in searched if cast(AlphaSearch, search).parent_output}
    parent_calls: dict[str, list] = {}
    if statistics is None:
        if stream is None:
            raise ValueError(f"layer {i}: SmoothQuant statistics need a calibration stream or cached statistics")
        sample_at = [m.consumers[0] for m in searched]
        with (
            ChannelMaxObserver(model, consumers) as observer,
            RowSampler(
                model, sample_at, search.max_rows if search else 0, means=search is not None and search.rule == Rule.AWQ
            ) as sampler,
            ParentSampler(model, list(parents.values()), search.parent_tokens if search else 0) as parent_sampler,
        ):
            settling = Settling(observer, early_stop)
            chunks = stream.chunks
            advance_stream(stream, layer, i, stop_after=lambda b: settling.after_batch(len(chunks[b])))
        last_change = settling.change[-1] if settling.change else 0.0
        statistics, rows = LayerStatistics(observer.maxima, settling.windows, last_change), sampler.rows
        means = {name: sampler.mean_abs(name) for name in sampler.abs_sum}
        parent_calls = parent_sampler.calls
    elif searched:
        raise ValueError("the alpha search samples rows during the statistics pass; cached statistics have none")
    maxima = statistics.maxima
    missing = [n for n in dict.fromkeys(consumers) if n not in maxima]
    if missing:
        raise RuntimeError(f"SmoothQuant calibration: these linears were never called in the forward pass: {missing}")
    sub_plan = MappingPlan("", tuple(mappings), ())
    _check_finite(sub_plan, maxima)
    _check_shared_input(sub_plan, maxima)

    def least_error(m: SmoothMapping, candidates: list[torch.Tensor]) -> tuple[int, list[float]]:
        """The searched mapping's candidate of least error and every candidate's error (`alpha_search`): the
        consumers' products on the sampled rows, or with `parent_output` their parent's output."""
        names = _quantized_consumers(m)
        if m.name in parents:
            linears = [(c, cast(nn.Linear, model.get_submodule(c))) for c in names]
            index = m.channel_index(linears[0][1].in_features, linears[0][1].weight.device)
            parent = parents[m.name]
            return choose_scales_by_parent(
                cast(AlphaSearch, search), model.get_submodule(parent), parent_calls[parent], linears, index, candidates
            )
        sampled = rows[m.consumers[0]]
        quantized = [(c, input_weight(model.get_submodule(c)).detach()) for c in names]
        index = m.channel_index(sampled.shape[-1], sampled.device)
        return choose_scales(cast(AlphaSearch, search), sampled, quantized, index, candidates)

    factors, alphas, errors = [], {}, {}
    for m in mappings:
        channels = _smoothing_channels(model, m)
        x = _to_smoothing_channels(m, maxima[m.consumers[0]], channels)
        w = _to_smoothing_channels(m, _weight_col_max(model, m).to(x.device), channels)
        alphas[m.name] = alpha
        if m in searched and cast(AlphaSearch, search).rule == Rule.AWQ:
            quantized = [input_weight(model.get_submodule(c)).detach() for c in _quantized_consumers(m)]
            block_of = cast(Callable[[str], tuple[int, int]], cast(AlphaSearch, search).weight_block)
            mean_w = weight_mean(quantized, [block_of(c) for c in _quantized_consumers(m)])
            x_mean = _to_smoothing_channels(m, means[m.consumers[0]].to(x.device), channels)
            w_mean = _to_smoothing_channels(m, mean_w.to(x.device), channels)
            candidates = [awq_factors(x_mean, w_mean, ratio, duo) for ratio, duo in AWQ_GRID]
            best, errors[m.name] = least_error(m, candidates)
            alphas[m.name] = AWQ_GRID[best][0]
            factors.append((m, candidates[best], x, w))
            continue
        if m in searched:
            grid = cast(AlphaSearch, search).grid
            best, errors[m.name] = least_error(m, [smoothing_factors(x, w, a, power_of_two) for a in grid])
            alphas[m.name] = grid[best]
        factors.append((m, smoothing_factors(x, w, alphas[m.name], power_of_two), x, w))
    return LayerFactors(factors, statistics, alphas, errors)


def _quantized_consumers(mapping: SmoothMapping) -> list[str]:
    """The mapping's consumers that are quantized (not `fold_only`)."""
    return [c for c in mapping.consumers if c not in mapping.fold_only]


def statistics_entry(
    location: CacheLocation | None,
    tokens: torch.Tensor,
    per_layer: Sequence[Sequence[SmoothMapping]],
    early_stop: EarlyStop | None,
    batch_size: int,
    search: AlphaSearch | None,
) -> StatisticsCache | None:
    """The statistics cache entry of this calibration (its key: `CacheLocation.entry`), None without a location or
    with the alpha search (which needs the rows the statistics pass samples)."""
    if location is None or search is not None:
        return None
    consumers = [list(dict.fromkeys(c for m in mappings for c in m.consumers)) for mappings in per_layer]
    return location.entry(tokens, consumers, early_stop, batch_size)


def _searchable(model: nn.Module, mapping: SmoothMapping) -> bool:
    """Whether the alpha search can measure `mapping`: every quantized consumer a Linear (not a fused experts
    matrix: a MoE norm keeps the recipe's alpha)."""
    try:
        modules = [model.get_submodule(c) for c in mapping.consumers if c not in mapping.fold_only]
    except AttributeError:
        return False
    return bool(modules) and all(isinstance(mod, nn.Linear) for mod in modules)


@torch.no_grad()
def _final_hidden(model: nn.Module, layers: nn.ModuleList, tokens: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """The last decoder layer's output per batch of `tokens` (eval mode, on the model's device)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        return [
            final_hidden(model, layers, tokens[i : i + batch_size].to(device))
            for i in range(0, len(tokens), batch_size)
        ]
    finally:
        model.train(was_training)


class HiddenBatches(Protocol):
    """Per batch, a hidden-state tensor: len() and [b] (a list, or a stream's batches spilled to disk)."""

    def __len__(self) -> int: ...

    def __getitem__(self, b: int, /) -> torch.Tensor: ...


@torch.no_grad()
def logit_change(
    model: nn.Module,
    layers: nn.ModuleList,
    reference: HiddenBatches,
    smoothed: HiddenBatches,
    architecture: str,
) -> tuple[float, float]:
    """(max |logit change|, max |reference logit|) over every batch and position of the verification windows.

    reference / smoothed: per batch, the last decoder layer's output (B, T, hidden) before and after folding (any
    object with len() and [b], e.g. batches spilled to disk). Logits are taken HEAD_POSITIONS positions at a time
    (`quantkit.calibrate.layers.head_logits`): the whole-model and streaming paths cut the same pieces, so both
    give the same numbers; a max does not depend on the order. NonFiniteStatisticsError if a reference logit is
    NaN/Inf (the check could not tell a bad fold from a bad model)."""
    change = scale = torch.zeros(())  # torch.maximum propagates NaN (Python's max would drop it)
    for b in range(len(reference)):
        ref_hidden, smoothed_hidden = reference[b], smoothed[b]
        for start in range(0, ref_hidden.shape[1], HEAD_POSITIONS):
            ref = head_logits(model, layers, ref_hidden, start)
            if not torch.isfinite(ref).all():
                raise NonFiniteStatisticsError(
                    f"SmoothQuant: {architecture} produces NaN/Inf logits before smoothing "
                    "(check the checkpoint and dtype)"
                )
            diff = (head_logits(model, layers, smoothed_hidden, start) - ref).abs().max()
            change, scale = torch.maximum(change, diff.cpu()), torch.maximum(scale, ref.abs().max().cpu())
    return change.item(), scale.item()


def smoothquant_report(
    plan: MappingPlan,
    alpha: float,
    tokens: torch.Tensor,
    calibrated: Sequence[LayerFactors],
    change: float,
    scale: float,
    tolerance: float,
    early_stop: EarlyStop | None,
    alpha_grid: Sequence[float] | None = None,
) -> SmoothQuantReport:
    """The report of a finished smoothing: each folded layer's mapping reports (`fold_layer`), the
    function-preservation figures, and the windows each layer's statistics saw."""
    mappings = [r for layer in calibrated for r in layer.reports]
    return SmoothQuantReport(
        architecture=plan.architecture,
        alpha=alpha,
        num_sequences=min(c.windows for c in calibrated),
        seq_len=tokens.shape[1],
        mappings=mappings,
        skipped=list(plan.skipped),
        max_logit_change=change,
        logit_scale=scale,
        relative_logit_change=change / max(scale, torch.finfo(torch.float32).tiny),
        tolerance=tolerance,
        windows_drawn=int(tokens.shape[0]),
        early_stop=None if early_stop is None else early_stop.tolerance,
        windows_per_layer=[c.windows for c in calibrated],
        last_change=[c.last_change for c in calibrated],
        scales={m.smooth: s.cpu() for layer in calibrated for m, s, _, _ in layer.factors},
        alpha_grid=None if alpha_grid is None else list(alpha_grid),
        alpha_errors={name: e for layer in calibrated for name, e in layer.alpha_errors.items()},
    )


def check_preserved(
    model: nn.Module,
    layers: nn.ModuleList,
    before: HiddenBatches,
    after: HiddenBatches,
    architecture: str,
    tolerance: float,
    undone: str = "the folds have been undone (up to rounding)",
) -> tuple[float, float]:
    """(max |logit change|, logit scale) between the final hidden states `before` and `after` the folds
    (`logit_change`); FunctionPreservationError when the change is above `tolerance` of the scale (or NaN), saying
    what the caller did about it (`undone`)."""
    change, scale = logit_change(model, layers, before, after, architecture)
    relative = change / max(scale, torch.finfo(torch.float32).tiny)
    if not relative <= tolerance:  # also catches NaN
        raise FunctionPreservationError(
            f"SmoothQuant changed the logits of {architecture}: max |logit change| {change:.4g} "
            f"= {relative:.3g} of the logit scale {scale:.4g}, above the tolerance {tolerance:.3g}; "
            f"{undone}. A mapping is not function-preserving for this model."
        )
    return change, scale


def smooth_model(
    model: nn.Module,
    calibration: Sequence[str] | torch.Tensor | Iterable[torch.Tensor] | None = None,
    tokenizer=None,
    alpha: float = DEFAULT_ALPHA,
    num_sequences: int | None = None,
    seq_len: int | None = None,
    include_v_o: bool = False,
    include_up_down: bool = False,
    experts: bool = True,
    power_of_two: bool = False,
    tolerance: float | None = None,
    batch_size: int = BATCH_SIZE,
    verify_tokens: torch.Tensor | None = None,
    progress: bool = True,
    early_stop: EarlyStop | None = None,
    search: AlphaSearch | None = None,
    statistics_cache: CacheLocation | None = None,
) -> SmoothQuantReport:
    """Smooth `model` in place and verify that it still computes the same function.

    calibration: a calibration source (`quantkit.data`; None: the model's default), a list of texts, an (N, T)
    token tensor, or an iterable of token batches (`calibration_tokens`). Statistics are gathered one decoder
    layer at a time (the streaming engine, here with every layer resident); the folds follow once every layer's
    are in; early_stop ends the windows once a layer's per-channel maxima settle (`stats.EarlyStop`).
    include_v_o / include_up_down add the optional mappings (see
    `quantkit.calibrate.mappings`; v->o is refused where it is not function-preserving). experts: smooth MoE
    layers' post_attention_layernorm into router, experts, shared expert and its gate (False: leave those
    norms unsmoothed, as peers do; no effect on dense models). power_of_two:
    round factors to powers of two (bit-exact folding in bf16). search: choose each mapping's alpha by the
    quantized output error (`quantkit.calibrate.alpha_search`; `alpha` stays the fallback for MoE norms).
    statistics_cache: read the per-channel maxima from there when an earlier run of the same source checkpoint,
    windows and mappings left them, else keep them there (`quantkit.calibrate.stats_cache`; unused with search).
    tolerance: max |logit change| / max |logit| allowed (default 1e-3; 5e-2 for bf16/fp16 parameters unless
    power_of_two), checked on `verify_tokens` (default: the first 4 calibration sequences).

    Raises SmoothQuantMappingError (structure), NonFiniteStatisticsError (NaN/Inf calibration statistics or
    logits, model untouched), FunctionPreservationError (logits changed; folds undone, up to rounding).
    """
    plan = resolve_mappings(model, include_v_o=include_v_o, include_up_down=include_up_down, experts=experts)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
    config = getattr(model, "config", None)
    max_positions = getattr(config, "max_position_embeddings", None)
    tokens = calibration_tokens(
        calibration, tokenizer, num_sequences, seq_len, max_positions, getattr(config, "model_type", None)
    )
    if tolerance is None:
        exact = power_of_two or next(model.parameters()).dtype in (torch.float32, torch.float64)
        tolerance = DEFAULT_TOLERANCE if exact else LOW_PRECISION_TOLERANCE
    verify = tokens[:DEFAULT_VERIFY_SEQUENCES] if verify_tokens is None else verify_tokens
    try:
        stack_name, layers = decoder_stack(model)
    except LayerwiseError as err:
        raise SmoothQuantMappingError(f"{err}: SmoothQuant calibrates one decoder layer at a time") from err
    per_layer = layer_mappings(plan, stack_name, len(layers))

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    calibrated: list[LayerFactors] = []
    folded: list[LayerFactors] = []
    try:
        reference = _final_hidden(model, layers, verify, batch_size)
        cache = statistics_entry(statistics_cache, tokens, per_layer, early_stop, batch_size, search)
        stream = embed_stream(model, layers, "smoothquant", tokens.to(device), None, batch_size, lazy=True)
        with reuse_or_record(cache, len(layers), device) as (cached, recorder):
            desc = "SmoothQuant calibration" + (" (cached statistics)" if cached else "")
            for i in tqdm(range(len(layers)), desc=desc, unit="layer", disable=not progress):
                statistics = None if cached is None else cached[i]
                calibrated.append(
                    layer_factors(
                        model, layers[i], i, stream, per_layer[i], alpha, power_of_two, early_stop, search, statistics
                    )
                )
                if recorder is not None:
                    recorder.save(i, calibrated[-1].statistics)
        del stream
        folded = calibrated  # every factor from the unsmoothed model; nothing folded before all are in
        for layer in folded:
            fold_layer(model, layer)
        after = _final_hidden(model, layers, verify, batch_size)
        change, scale = check_preserved(model, layers, reference, after, plan.architecture, tolerance)
    except Exception:  # the model is left as it came, up to rounding
        for m, s, _, _ in reversed([f for layer in folded for f in layer.factors]):
            fold_mapping(model, m, 1.0 / s)
        raise
    finally:
        model.train(was_training)

    grid = None if search is None else search.searched_values()
    report = smoothquant_report(plan, alpha, tokens, calibrated, change, scale, tolerance, early_stop, grid)
    logger.info("SmoothQuant done:\n%s", report.summary())
    return report
