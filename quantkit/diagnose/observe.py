"""Forward hooks that accumulate the diagnostics statistics batch by batch (nothing is stored per token).

`DiagnosticsObserver(model, ...)` is a context manager: hooks exist only inside the `with` block and are
removed in `__exit__` (also when a forward pass raises), so an undiagnosed model pays nothing. Sites:

- residual stream H_i (paper 000 sec. 2: H_{i+1} = H_i + F_i(H_i)): the input of decoder layer i for
  i < D and the input of the final norm for i = D, i.e. the D + 1 states of the paper's H_avg;
- every nn.Linear: its input x (max |x|, moments, per-channel max) and, per recipe that quantizes it, the
  output error of fake-quantized x and W against the float product;
- attention probabilities a[b, h, t, j] (query t, key j) returned by each softmax-attention layer's
  self_attn under transformers' eager attention; layers without one (hybrid models' Gated DeltaNet
  `linear_attn` layers) are listed in `attention_skipped` with the reason;
- GatedNorm gates sigmoid(gate_up(...)) of the residual norms;
- fused routed experts (MoE, `quantkit.formats.experts`): the router's top-k ids (load per expert) and, per
  expert, max |x| per channel at the input of gate/up and of down_proj on its routed tokens, and per recipe
  the output error of each expert matrix (`quantkit.quantize.routed_experts`).

Memory per model: O(layers x hidden) for the residual, O(in_features) per linear, O(layers x heads +
N^2) for attention, O(experts x (hidden + intermediate)) per MoE layer, plus one decoded copy of each
quantized weight (expert matrices included) per scheme (float32), released layer by layer (`release_weights`)
when the model runs one layer at a time (`quantkit.diagnose.run.diagnose`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.calibrate.mappings import layer_norms
from quantkit.diagnose.stats import ChannelStats, Moments
from quantkit.errors import NonFiniteStatisticsError
from quantkit.formats.constants import WeightScales
from quantkit.formats.experts import expert_matrices, fused_experts_modules
from quantkit.formats.schemes import get_scheme
from quantkit.quantize.recipe import Recipe
from quantkit.quantize.routed_experts import experts_call, projection_outputs, routed_expert_passes

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SINK_EPS = 0.3  # paper 002 eq. 1 (after Gu et al. 2025)
SINK_WINDOW = 64  # T_eps of paper 002 eq. 1
TOKEN_NORM_POSITIONS = 16  # paper 002 Fig. 1/5 compare token 0 with positions 1..15
EXPERTS_CHECK_RTOL = 1e-3  # recomputed experts vs the module's output, relative to max |output| (see _experts_hook)


def decoder_layers(model: nn.Module) -> tuple[nn.ModuleList, nn.Module]:
    """(model.model.layers, model.model.norm) of a decoder-only transformers model; ValueError otherwise."""
    backbone = getattr(model, "model", None)
    layers, norm = getattr(backbone, "layers", None), getattr(backbone, "norm", None)
    if not isinstance(layers, nn.ModuleList) or norm is None:
        raise ValueError(
            f"{type(model).__name__}: expected a decoder with .model.layers and .model.norm "
            "(Qwen3, Llama, quantkit family)"
        )
    return layers, norm


def residual_norm_names(model: PreTrainedModel) -> list[str]:
    """Qualified names of the residual-stream norms: each decoder layer's own norms of the residual width
    (`layer_norms`: Llama's input/post-attention pair, Gemma 2/3's four), in module order, then the final norm."""
    layers, _ = decoder_layers(model)
    width = model.get_input_embeddings().weight.shape[1]
    return [f"model.layers.{i}.{name}" for i, layer in enumerate(layers) for name in layer_norms(layer, width)] + [
        "model.norm"
    ]


@dataclass
class ResidualState:
    """Accumulators for one residual state H_i: moments, per-dim stats, massive-token counts."""

    moments: Moments = field(default_factory=Moments)
    channels: ChannelStats | None = None
    massive: int = 0  # tokens with max_j |h_tj| > ratio * median |h| of their sequence
    massive_pos0: int = 0  # ... of them at position 0
    massive_positions: Counter = field(default_factory=Counter)
    ratio_sum_pos0: float = 0.0  # sum over sequences of that ratio at position 0
    ratio_sum_rest: float = 0.0  # ... at positions >= 1
    tokens: int = 0
    sequences: int = 0
    token_norm_sum: torch.Tensor | None = None  # sum over sequences of ||h_t||_2, positions 0..15


@dataclass
class AttentionLayer:
    """Accumulators for one layer's attention probabilities (per head, summed over sequences)."""

    alpha_sum: torch.Tensor  # (H,) sum of alpha_0^{l,h} (paper 002 eq. 1)
    sink_count: torch.Tensor  # (H,) number of sequences with alpha_0^{l,h} > eps
    mass_sum: torch.Tensor  # (H,) sum of first-token mass M_0^{l,h} / T (paper 002 eq. 2)
    map_sum: torch.Tensor  # (N, N) sum over sequences and heads of a[:N, :N]
    sequences: int = 0


@dataclass
class ExpertsStats:
    """Accumulators for one fused experts module with E experts (hidden H, intermediate I), top-k routing."""

    slots: torch.Tensor  # (E,) float64: routed (token, slot) pairs per expert
    gate_up_input_max: torch.Tensor  # (E, H) float32: max |x_j| over the tokens routed to e
    down_input_max: torch.Tensor  # (E, I) float32: max |h_j| at down_proj's input
    tokens: int = 0
    top_k: int = 0


@dataclass
class LinearStats:
    moments: Moments = field(default_factory=Moments)
    channel_max: torch.Tensor | None = None
    signal: float = 0.0  # sum y^2 (float product)
    noise: dict[str, float] = field(default_factory=dict)  # recipe -> sum (y - y_q)^2


class DiagnosticsObserver:
    """Hooks collecting residual, linear-input, attention and gate statistics; use as a context manager.

    `recipes`: {recipe name: (recipe, static NVFP4 input decode scale per linear, or None for per-token)}.
    Call `begin_batch(input_ids, key)` before each forward pass, or before each batch's pass through one layer
    when the model runs layer by layer, and `end_batch(key)` once the batch has gone through every layer
    (massive tokens are attributed to token ids); `paused()` stops the statistics for a pass of another purpose.
    """

    def __init__(
        self,
        model: nn.Module,
        recipes: dict[str, tuple[Recipe, dict[str, torch.Tensor] | None]],
        massive_ratio: float,
        map_tokens: int,
    ) -> None:
        self.model = model
        self.layers, self.final_norm = decoder_layers(model)
        self.massive_ratio = massive_ratio
        self.map_tokens = map_tokens
        self.recipes = recipes
        self.residual = [ResidualState() for _ in range(len(self.layers) + 1)]
        self.attention: dict[int, AttentionLayer | None] = {
            i: None for i, layer in enumerate(self.layers) if isinstance(getattr(layer, "self_attn", None), nn.Module)
        }
        self.attention_skipped = {
            i: _no_softmax_reason(layer) for i, layer in enumerate(self.layers) if i not in self.attention
        }
        self.linears = {n: LinearStats() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        self.experts_modules = fused_experts_modules(model)
        self.experts: dict[str, ExpertsStats] = {}
        for name, module in self.experts_modules.items():  # expert matrices: linears by name (SNR)
            self.linears.update({m: LinearStats() for m in expert_matrices(name, module)})
        self.gates: dict[str, ChannelStats] = {}
        self.massive_token_ids: Counter = Counter()
        self._quantized: dict[tuple[str, str, str], torch.Tensor] = {}  # (linear, scheme, scales) -> weight
        self._handles: list = []
        self._ids: dict[int, torch.Tensor] = {}  # batch key -> (B, T) input ids
        self._massive_any: dict[int, torch.Tensor] = {}  # batch key -> (B, T) massive in some state so far
        self._batch: int | None = None
        self._paused = False

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> DiagnosticsObserver:
        try:
            for i, layer in enumerate(self.layers):
                self._handles.append(
                    layer.register_forward_pre_hook(self._gated(self._residual_hook(i)), with_kwargs=True)
                )
                if i in self.attention:  # only layers whose self_attn is an nn.Module (__init__)
                    self_attn = cast(nn.Module, layer.self_attn)
                    self._handles.append(self_attn.register_forward_hook(self._gated(self._attention_hook(i))))
            self._handles.append(
                self.final_norm.register_forward_pre_hook(
                    self._gated(self._residual_hook(len(self.layers))), with_kwargs=True
                )
            )
            for name, module in self.model.named_modules():
                if isinstance(module, nn.Linear):
                    self._handles.append(module.register_forward_hook(self._gated(self._linear_hook(name))))
            for name, module in self.experts_modules.items():
                self._handles.append(
                    module.register_forward_hook(self._gated(self._experts_hook(name)), with_kwargs=True)
                )
            for norm in residual_norm_names(self.model):
                gate_up = getattr(self.model.get_submodule(norm), "gate_up", None)
                if gate_up is not None:
                    self._handles.append(gate_up.register_forward_hook(self._gated(self._gate_hook(norm))))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._quantized.clear()

    def begin_batch(self, input_ids: torch.Tensor, key: int = 0) -> None:
        """The batch `key` (input ids (B, T)) runs next."""
        self._batch = key
        if key not in self._ids:
            self._ids[key] = input_ids
            self._massive_any[key] = torch.zeros(input_ids.shape, dtype=torch.bool)

    def end_batch(self, key: int = 0) -> None:
        """Count the token ids of batch `key`'s positions that were massive in at least one residual state."""
        ids, massive = self._ids.pop(key), self._massive_any.pop(key)
        self.massive_token_ids.update(ids[massive.to(ids.device)].tolist())
        self._batch = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No statistics inside (e.g. a calibration pass over the same layer)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def release_weights(self) -> None:
        """Forget the decoded quantized weights (layer by layer: those of the layer just done)."""
        self._quantized.clear()

    def _gated(self, hook):
        def gated(*args, **kwargs):
            return None if self._paused else hook(*args, **kwargs)

        return gated

    # -- hooks -------------------------------------------------------------------------------------
    def _residual_hook(self, i: int):
        def hook(_module, args, kwargs):
            h = (args[0] if args else kwargs["hidden_states"]).detach().float()  # (B, T, d)
            _check_finite(h, f"residual stream H_{i}")
            self._update_residual(self.residual[i], h)

        return hook

    def _update_residual(self, state: ResidualState, h: torch.Tensor) -> None:
        b, t, d = h.shape
        state.moments.update(h)
        if state.channels is None:
            state.channels = ChannelStats(d)
            state.token_norm_sum = torch.zeros(min(t, TOKEN_NORM_POSITIONS), dtype=torch.float64)
        state.channels.update(h)
        a = h.abs()
        tiny = torch.finfo(torch.float32).tiny
        median = a.reshape(b, -1).median(dim=1).values.clamp_min(tiny)  # (B,)
        ratio = a.amax(-1) / median[:, None]  # (B, T)
        # Massive: some |h_tj| is r x the state's median AND r x its own dimension's median over the sequence's
        # tokens. The second test keeps residual sinks out (dimensions large at every token, e.g. Gemma's):
        # with the first alone every token of such a model is "massive".
        dim_median = a.median(dim=1, keepdim=True).values.clamp_min(tiny)  # (B, 1, d)
        outstanding = (a > self.massive_ratio * median[:, None, None]) & (a > self.massive_ratio * dim_median)
        massive = outstanding.any(-1)  # (B, T)
        state.massive += int(massive.sum())
        state.massive_pos0 += int(massive[:, 0].sum())
        state.massive_positions.update(massive.nonzero()[:, 1].tolist())
        state.ratio_sum_pos0 += ratio[:, 0].double().sum().item()
        state.ratio_sum_rest += ratio[:, 1:].double().sum().item()
        state.tokens += b * t
        state.sequences += b
        positions = len(cast(torch.Tensor, state.token_norm_sum))  # set with state.channels, above
        state.token_norm_sum += h[:, :positions].double().norm(dim=-1).sum(0)
        if self._batch is not None:
            self._massive_any[self._batch] |= massive.cpu()

    def _attention_hook(self, i: int):
        def hook(_module, _args, output):
            probs = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if probs is None:
                raise RuntimeError(
                    f"layer {i}: self_attn returned no attention probabilities; load the model with "
                    "attn_implementation='eager'"
                )
            p = probs.detach().float()  # (B, H, T, T), rows sum to 1
            _check_finite(p, f"attention probabilities of layer {i}")
            b, heads, t, _ = p.shape
            first = p[..., 0]  # (B, H, T): a_{t0}
            alpha = first[..., : min(SINK_WINDOW, t)].mean(-1)  # (B, H), eq. 1 with s = 0
            n = min(self.map_tokens, t)
            if self.attention[i] is None:
                self.attention[i] = AttentionLayer(
                    torch.zeros(heads, dtype=torch.float64),
                    torch.zeros(heads, dtype=torch.float64),
                    torch.zeros(heads, dtype=torch.float64),
                    torch.zeros(n, n, dtype=torch.float64),
                )
            acc = self.attention[i]
            acc.alpha_sum += alpha.double().sum(0)
            acc.sink_count += (alpha > SINK_EPS).double().sum(0)
            acc.mass_sum += first.double().mean(-1).sum(0)
            acc.map_sum += p[:, :, :n, :n].double().sum((0, 1))
            acc.sequences += b

        return hook

    def _linear_hook(self, name: str):
        def hook(module: nn.Linear, args, output):
            x = args[0].detach()
            _check_finite(x, f"input of {name}")
            stats = self.linears[name]
            stats.moments.update(x)
            amax = x.reshape(-1, x.shape[-1]).abs().amax(0).float()
            stats.channel_max = amax if stats.channel_max is None else torch.maximum(stats.channel_max, amax)
            self._quant_error(name, module.weight, module.bias, x, output)

        return hook

    def _quant_error(
        self, name: str, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, y: torch.Tensor
    ) -> None:
        """Add sum y^2 and, per recipe quantizing `name`, sum (y - y_q)^2 to the matrix's stats (y = x W^T + b)."""
        quantizing = [(r, s) for r, s in self.recipes.values() if not r.ignores(name)]
        if not quantizing:
            return
        stats = self.linears[name]
        y = y.detach().double()
        stats.signal += y.pow(2).sum().item()
        for recipe, static_scale in quantizing:
            scheme = recipe.scheme_of(name)  # mixed precision by module: this matrix's
            w_q = self._quantized_weight(name, weight, scheme, recipe.weight_scales)
            x_q = get_scheme(scheme).fake_quant_activation(x, None if static_scale is None else static_scale[name])
            y_q = F.linear(x_q, w_q, None if bias is None else bias.float())
            stats.noise[recipe.name] = stats.noise.get(recipe.name, 0.0) + (y - y_q.double()).pow(2).sum().item()

    def _quantized_weight(self, name: str, weight: torch.Tensor, scheme: str, weight_scales: str) -> torch.Tensor:
        key = (name, scheme, weight_scales)
        if key not in self._quantized:
            w = weight.detach()
            s = get_scheme(scheme)
            if weight_scales == WeightScales.MINMAX:  # the same bits without packing (NVFP4: ~2x faster on CPU)
                self._quantized[key] = s.fake_quant_weight(w, name).to(w.device)
            else:
                self._quantized[key] = s.decode(s.encode(w, name, weight_scales), w.shape[1]).to(w.device)
        return self._quantized[key]

    def _experts_hook(self, name: str):
        """Load, input maxima and per-matrix error of each routed expert; checks the recomputation.

        The experts are recomputed per expert (`routed_expert_passes`) and their routing-weighted sum must match
        the module's output to EXPERTS_CHECK_RTOL x max |output|: the same float32 products summed in another
        order differ by at most ~(H + I + k) 2^-24 relative (worst case; 1.5e-4 for Qwen3-Next's H = 2048,
        I = 512), a module computing something else (another layout, a bias) by O(1).
        """

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
            hidden, top_k_index, top_k_weights = experts_call(args, kwargs)
            index = top_k_index.reshape(-1, top_k_index.shape[-1])
            _check_finite(hidden, f"input of {name}")
            experts, two_i, h_dim = cast(torch.Tensor, module.gate_up_proj).shape
            if name not in self.experts:
                self.experts[name] = ExpertsStats(
                    torch.zeros(experts, dtype=torch.float64),
                    torch.zeros(experts, h_dim),
                    torch.zeros(experts, two_i // 2),
                    top_k=index.shape[1],
                )
            acc = self.experts[name]
            acc.tokens += index.shape[0]
            acc.slots += torch.bincount(index.reshape(-1).cpu(), minlength=experts)[:experts].double()
            weights = top_k_weights.reshape(index.shape).detach().float()
            recomputed = torch.zeros(index.shape[0], h_dim, dtype=torch.float32, device=output.device)
            matrices = expert_matrices(name, module)  # "<name>.<e>.<proj>" -> (out, in) view
            for p in routed_expert_passes(module, hidden, index):
                _check_finite(p.h, f"input of {name}.{p.expert}.down_proj")
                acc.gate_up_input_max[p.expert] = torch.maximum(
                    acc.gate_up_input_max[p.expert], p.x.abs().amax(0).float().cpu()
                )
                acc.down_input_max[p.expert] = torch.maximum(
                    acc.down_input_max[p.expert], p.h.abs().amax(0).float().cpu()
                )
                for proj, (x, y) in projection_outputs(p).items():
                    matrix = f"{name}.{p.expert}.{proj}"
                    self._quant_error(matrix, matrices[matrix], None, x, y)
                recomputed.index_add_(0, p.token_idx, p.y.float() * weights[p.token_idx, p.slot, None])
            out = output.detach().reshape(recomputed.shape).float()
            gap, peak = (recomputed - out).abs().max().item(), out.abs().max().item()
            if gap > EXPERTS_CHECK_RTOL * peak:
                raise RuntimeError(
                    f"{name}: the per-expert recomputation differs from the module's output by {gap:.3g} "
                    f"(max |output| {peak:.3g}): it does not compute down_e(act(gate_e x) * up_e x) in "
                    "the layout of quantkit.formats.experts"
                )

        return hook

    def _gate_hook(self, norm: str):
        def hook(_module, _args, output):
            g = torch.sigmoid(output.detach().float())
            if norm not in self.gates:
                self.gates[norm] = ChannelStats(g.shape[-1])
            self.gates[norm].update(g)

        return hook


def _no_softmax_reason(layer: nn.Module) -> str:
    """Why a decoder layer has no softmax attention probabilities to diagnose."""
    mixer = getattr(layer, "linear_attn", None)
    if isinstance(mixer, nn.Module):
        return f"linear attention ({type(mixer).__name__} `linear_attn`): no softmax, no attention probabilities"
    return f"{type(layer).__name__} has no `self_attn` module"


def _check_finite(x: torch.Tensor, where: str) -> None:
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise NonFiniteStatisticsError(f"{bad} non-finite value(s) (NaN/Inf) at the {where}, shape {tuple(x.shape)}")
