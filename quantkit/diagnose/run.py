"""Outlier diagnostics of a checkpoint on held-out windows (definitions: docs/diagnostics.md).

    diagnose(model_dir, num_sequences, seq_len, recipes=...) -> dict      (JSON-serializable)
    diagnose_model(model, tokens, recipes=...) -> dict                    (a model already in memory)
    write_diagnostics(result, out_dir) -> [paths]                         (JSON, summary, PNG/SVG figures)

Conventions: residual state i is H_i of paper 000 sec. 2 (input of decoder layer i; i = D is the input of
the final norm); positions are 0-based, position 0 is the window's first token (BOS for
`heldout_windows`); magnitudes are in the model's activation units; SNR in dB; floats in the
result are rounded to 6 significant digits, and undefined or infinite values (kurtosis of a constant, SNR
of an exact product or of an all-zero output) are null. Hybrid models: attention-sink statistics cover the
softmax-attention layers (the others are listed with the reason), MoE layers add per-expert load, input maxima
and SNR (`experts`, `expert_snr_db`; docs/diagnostics.md "Hybrid MoE models").
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from tqdm import tqdm

import quantkit.calibrate.layers as layer_engine
from quantkit.atomic import write_text_atomic
from quantkit.calibrate.mappings import OFFSET_NORMS
from quantkit.calibrate.stats import ChannelMaxObserver, run_batches
from quantkit.data import heldout_windows
from quantkit.diagnose.defaults import DEFAULT_NUM_SEQUENCES, DEFAULT_RECIPES, DEFAULT_SEQ_LEN, MASSIVE_RATIO
from quantkit.diagnose.observe import (
    SINK_EPS,
    SINK_WINDOW,
    DiagnosticsObserver,
    decoder_layers,
    residual_norm_names,
)
from quantkit.diagnose.stats import ChannelStats
from quantkit.errors import NonFiniteStatisticsError
from quantkit.formats import nvfp4_global_scale
from quantkit.formats.experts import expert_matrices, fused_experts_modules
from quantkit.formats.schemes import SCHEMES
from quantkit.metrics import sensitivity_by_kind, snr_db
from quantkit.quantize.recipe import Backend, Recipe, load_recipe
from quantkit.quantize.routed_experts import summarize_expert_snr

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MAP_TOKENS = 32  # attention maps are shown for the first 32 queries x keys
TOP_K = 8
NORM_PARAMS = {"weight": 1.0, "pre_scale": 1.0, "bias": 0.0, "alpha": None}  # parameter -> neutral value


def why_not_diagnosable(recipe: Recipe) -> str | None:
    """Why diagnose cannot emulate `recipe`'s quantization error, or None when it can: backend quantkit, one of its
    schemes, no SmoothQuant, rotation, GPTQ or unresolved bit budget (round to nearest, the recipe's weight scales and
    module schemes)."""
    if recipe.backend != Backend.QUANTKIT or recipe.scheme not in SCHEMES:
        return (
            f"recipe {recipe.name!r} (backend {recipe.backend}, scheme {recipe.scheme}): diagnose "
            f"emulates quantkit's schemes ({', '.join(SCHEMES)}) only"
        )
    if recipe.smoothquant is not None or recipe.rotation is not None:
        return (
            f"recipe {recipe.name!r} applies {'SmoothQuant' if recipe.smoothquant else 'rotation'} first; "
            "diagnose measures the checkpoint as it is: use the recipe without it (e.g. w4a4_nvfp4)"
        )
    if recipe.gptq is not None:
        return (
            f"recipe {recipe.name!r} rounds its weights by GPTQ, which needs calibration; diagnose rounds to "
            "nearest: use the recipe without it (e.g. w4a4_nvfp4)"
        )
    if recipe.bit_budget is not None and recipe.bit_budget_choice is None:
        return (
            f"recipe {recipe.name!r} chooses its schemes per module from diagnose's own figures; "
            "diagnose the recipe's scheme (e.g. w4a4_nvfp4)"
        )
    return None


def resolve_recipes(names: Sequence[str | Recipe]) -> list[Recipe]:
    """Recipes (by name, or given) whose quantization error diagnose can emulate (`why_not_diagnosable`); ValueError
    naming the first it cannot."""
    recipes = []
    for name in names:
        recipe = name if isinstance(name, Recipe) else load_recipe(name)  # ValueError for an unknown name
        if (reason := why_not_diagnosable(recipe)) is not None:
            raise ValueError(reason)
        recipes.append(recipe)
    return recipes


def diagnose(
    model_dir: str | Path,
    num_sequences: int = DEFAULT_NUM_SEQUENCES,
    seq_len: int = DEFAULT_SEQ_LEN,
    recipes: Sequence[str | Recipe] = DEFAULT_RECIPES,
    batch_size: int = 8,
    massive_ratio: float = MASSIVE_RATIO,
    progress: bool = True,
) -> dict:
    """Diagnostics of the checkpoint in `model_dir` on `num_sequences` held-out windows of `seq_len` tokens."""
    from transformers import AutoConfig, AutoTokenizer

    import quantkit.models  # noqa: F401  (registers model_type "quantkit")

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a checkpoint directory (no config.json)")
    if "quantization_config" in json.loads((model_dir / "config.json").read_text()):
        raise ValueError(
            f"{model_dir} is a quantized checkpoint; diagnose its unquantized source (the recipes "
            "emulate the quantization)"
        )
    recipe_list = resolve_recipes(recipes)  # fail before loading anything
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    seq_len = min(seq_len, config.max_position_embeddings)
    tokens = heldout_windows(tokenizer, num_sequences, seq_len)
    result = _diagnose_layerwise(model_dir, config, tokens, recipe_list, batch_size, massive_ratio, progress, tokenizer)
    result["model"]["path"] = str(model_dir)
    return result


@torch.no_grad()
def _diagnose_layerwise(
    model_dir: Path,
    config,
    tokens: torch.Tensor,
    recipe_list: list[Recipe],
    batch_size: int,
    massive_ratio: float,
    progress: bool,
    tokenizer: Any,
) -> dict:
    """`diagnose_model`'s statistics with one decoder layer in memory at a time (`quantkit.calibrate.layers`):
    the windows are embedded, then each layer is read from the checkpoint (float32), its static scales calibrated
    on the batches entering it, the batches run through it under the observer's hooks, and it goes back to the
    meta device with its decoded quantized weights. The final norm's input is H_D; the lm_head runs on
    `HEAD_POSITIONS` positions at a time (its input statistics; no vocabulary-sized logits for whole windows).
    Every statistic sees the same batches in the same order as in `diagnose_model` (the head's in pieces)."""
    layer_engine.pin_mmap_threshold()
    model = layer_engine.skeleton_model(config, attn_implementation="eager")
    stack, layers = layer_engine.decoder_stack(model)
    reader = layer_engine.open_source(model_dir, config.model_type)
    before_head, head_keys = layer_engine.outside_keys(model)
    tied = layer_engine.tied_partners(model)  # before the embeddings go back to the meta device (untying them)
    layer_engine.load_outside(model, reader, before_head, tied)
    stream = layer_engine.embed_stream(model, layers, "diagnose", tokens, None, batch_size)
    model.get_input_embeddings().to("meta")
    plan: dict[str, tuple[Recipe, dict[str, torch.Tensor] | None]] = {
        r.name: (r, {} if r.static_activations else None) for r in recipe_list
    }
    norms, input_norms = [], []
    norm_names = residual_norm_names(model)
    with DiagnosticsObserver(model, plan, massive_ratio, MAP_TOKENS) as obs:
        for i in tqdm(range(len(layers)), desc="diagnose", unit="layer", disable=not progress):
            prefix = f"{stack}.{i}."
            layer = layers[i]
            layer_engine.materialize(
                layer, layer_engine.source_tensors(reader, layer, prefix, model_dir), f"{model_dir} layer {i}"
            )
            layer.eval()
            for recipe, scales in plan.values():
                if scales is not None:
                    with obs.paused():
                        scales.update(
                            _static_scales(model, recipe, prefix, functools.partial(_run_layer, stream, layer, i))
                        )
            norms += _norm_entries(model, [n for n in norm_names if n.startswith(prefix)], TOP_K)
            input_norms.append(_input_norm_params(layer))
            layer_engine.advance_stream(stream, layer, i, before_batch=lambda b: obs.begin_batch(stream.chunks[b], b))
            obs.release_weights()
            layer.to("meta")
        _, final_norm = decoder_layers(model)
        lm_head = model.get_output_embeddings()
        layer_engine.load_outside(model, reader, head_keys, tied)  # its input statistics, as in the whole model
        for b in range(len(stream.hidden)):  # H_D: the final norm's input
            obs.begin_batch(stream.chunks[b], b)
            normed = final_norm(stream.hidden[b])
            for start in range(0, normed.shape[1], layer_engine.HEAD_POSITIONS) if head_keys else ():
                lm_head(normed[:, start : start + layer_engine.HEAD_POSITIONS])
            obs.end_batch(b)
    norms += _norm_entries(model, norm_names[-1:], TOP_K)
    return _result(obs, model, plan, tokens, norms, input_norms, massive_ratio, MAP_TOKENS, TOP_K, tokenizer)


def _run_layer(stream: layer_engine.Stream, layer: nn.Module, i: int) -> None:
    """Every batch of `stream` through decoder layer i, outputs discarded (a calibration pass)."""
    for b in range(len(stream.hidden)):
        layer(stream.hidden[b], **stream.layer_kwargs[b][i])


@torch.no_grad()
def diagnose_model(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    recipes: Sequence[str] = DEFAULT_RECIPES,
    batch_size: int = 8,
    massive_ratio: float = MASSIVE_RATIO,
    map_tokens: int = MAP_TOKENS,
    top_k: int = TOP_K,
    progress: bool = False,
    tokenizer: Any = None,
) -> dict:
    """Diagnostics of `model` on token windows `tokens` (N, T) int64; see the module docstring for conventions.

    The model runs with eager attention for the duration (restored afterwards) and its hooks are removed on
    return or error. `tokenizer` (optional) decodes the ids of massive tokens.
    """
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be (num_sequences, seq_len >= 2), got shape {tuple(tokens.shape)}")
    recipe_list = resolve_recipes(recipes)
    layers, _ = decoder_layers(model)
    was_training, attn_impl = model.training, model.config._attn_implementation
    model.eval()
    try:
        if attn_impl != "eager":
            model.set_attn_implementation("eager")
        plan = {
            r.name: (
                r,
                _static_scales(model, r, "", lambda: run_batches(model, tokens, batch_size, False, ""))
                if r.static_activations
                else None,
            )
            for r in recipe_list
        }
        device = next(model.parameters()).device
        with DiagnosticsObserver(model, plan, massive_ratio, map_tokens) as obs:
            for start in tqdm(range(0, len(tokens), batch_size), desc="diagnose", unit="batch", disable=not progress):
                chunk = tokens[start : start + batch_size].to(device)
                obs.begin_batch(chunk)
                model(input_ids=chunk, use_cache=False)
                obs.end_batch()
    finally:
        if model.config._attn_implementation != attn_impl:
            model.set_attn_implementation(attn_impl)
        model.train(was_training)
    norms = _norm_entries(model, residual_norm_names(model), top_k)
    return _result(
        obs,
        model,
        plan,
        tokens,
        norms,
        [_input_norm_params(layer) for layer in layers],
        massive_ratio,
        map_tokens,
        top_k,
        tokenizer,
    )


def _result(
    obs: DiagnosticsObserver,
    model: PreTrainedModel,
    plan: dict,
    tokens: torch.Tensor,
    norms: list[dict],
    input_norms: list[dict[str, torch.Tensor | None]],
    massive_ratio: float,
    map_tokens: int,
    top_k: int,
    tokenizer: Any,
) -> dict:
    """The result dict from the observer's statistics and the norms' parameters (whole model or layer by layer)."""
    config = model.config
    bos = getattr(config, "bos_token_id", None)
    result: dict[str, Any] = {
        "model": {
            "architecture": type(model).__name__,
            "variant": getattr(config, "variant_name", config.model_type),
            "num_layers": len(input_norms),
            "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads,
        },
        "settings": {
            "num_sequences": int(tokens.shape[0]),
            "seq_len": int(tokens.shape[1]),
            "recipes": list(plan),
            "massive_ratio": massive_ratio,
            "sink_eps": SINK_EPS,
            "sink_window": min(SINK_WINDOW, int(tokens.shape[1])),
            "attention_map_tokens": min(map_tokens, int(tokens.shape[1])),
            "top_k": top_k,
            "position0_is_bos": bos is not None and bool((tokens[:, 0] == bos).all()),
        },
        "residual": _residual(obs),
        "norms": norms,
        "gates": _gates(obs, top_k),
        "attention": _attention(obs),
        "linears": _linears(obs, top_k),
        "experts": _experts(obs, top_k),
        "quant_snr_db": {
            name: {n: snr_db(s.signal, s.noise[name]) for n, s in obs.linears.items() if name in s.noise}
            for name in plan
        },
    }
    result["expert_snr_db"] = {name: summarize_expert_snr(snr) for name, snr in result["quant_snr_db"].items()}
    result["sensitivity"] = {name: sensitivity_by_kind(snr) for name, snr in result["quant_snr_db"].items()}
    result["sink_dims"] = _sink_dims(obs, input_norms, top_k)
    result["massive"] = _massive(obs, massive_ratio, tokenizer, top_k)
    result["summary"] = _summary(result)
    return _clean(result)


def _static_scales(model: nn.Module, recipe: Recipe, prefix: str, run: Callable[[], None]) -> dict[str, torch.Tensor]:
    """Static NVFP4 input decode scale of each quantized linear and expert matrix under `prefix` ("" for all):
    amax over the windows `run()` sends through them / 2688, as `quantize` calibrates (expert matrices in
    calibrate-all-experts mode, `quantkit.calibrate.stats`)."""
    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n.startswith(prefix) and not recipe.ignores(n)
    ]
    names += [
        m
        for n, e in fused_experts_modules(model).items()
        if n.startswith(prefix)
        for m in expert_matrices(n, e)
        if not recipe.ignores(m)
    ]
    with ChannelMaxObserver(model, names) as observer:
        run()
    missing = [n for n in observer.names if n not in observer.maxima]
    if missing:
        raise RuntimeError(
            f"static activation calibration: these linears were never called in the forward pass: {missing}"
        )
    return {n: nvfp4_global_scale(m.max()) for n, m in observer.maxima.items()}


def _residual(obs: DiagnosticsObserver) -> dict:
    states = obs.residual
    return {
        "states": [f"layers.{i}.input" for i in range(len(states) - 1)] + ["norm.input"],
        "max_abs": [s.moments.max_abs for s in states],
        "kurtosis": [s.moments.kurtosis for s in states],
        "std": [s.moments.std for s in states],
        # channels and token_norm_sum: set by the state's first batch (ResidualState)
        "mean_abs_per_dim": [cast(ChannelStats, s.channels).mean_abs.tolist() for s in states],
        "token_norm_pos0": [float(cast(torch.Tensor, s.token_norm_sum)[0] / s.sequences) for s in states],
        "token_norm_pos1_15": [
            float(cast(torch.Tensor, s.token_norm_sum)[1:].mean() / s.sequences)
            if len(cast(torch.Tensor, s.token_norm_sum)) > 1
            else None
            for s in states
        ],
    }


def _sink_dims(obs: DiagnosticsObserver, input_norms: list[dict[str, torch.Tensor | None]], top_k: int) -> list[dict]:
    """Dimensions ranked by H_avg^j = mean over states and tokens of |H_ij| (paper 000 sec. 2), largest first.
    input_norms: per layer, its input norm's parameters (`_input_norm_params`)."""
    mean_abs = torch.stack([cast(ChannelStats, s.channels).mean_abs for s in obs.residual])  # (D+1, d)
    max_abs = torch.stack([cast(ChannelStats, s.channels).max_abs for s in obs.residual]).amax(0)
    h_avg = mean_abs.mean(0)
    median = h_avg.median().clamp_min(1e-30)
    weights = {}  # input norm parameter (L, d) where every layer has one of the residual width
    for attr in ("weight", "pre_scale"):
        values = [n[attr] for n in input_norms]
        if all(isinstance(v, torch.Tensor) and v.numel() == h_avg.numel() for v in values):
            weights[attr] = torch.stack(cast(list[torch.Tensor], values))
    out = []
    for j in h_avg.argsort(descending=True)[:top_k].tolist():
        entry = {
            "dim": j,
            "mean_abs": h_avg[j].item(),
            "ratio_to_median": (h_avg[j] / median).item(),
            "max_abs": max_abs[j].item(),
        }
        for attr, w in weights.items():
            entry[f"input_norm_{attr}_mean"] = w[:, j].mean().item()
        out.append(entry)
    return out


def _massive(obs: DiagnosticsObserver, ratio: float, tokenizer: Any, top_k: int) -> dict:
    per_state = []
    for s in obs.residual:
        per_state.append(
            {
                "count": s.massive,
                "fraction": s.massive / s.tokens,
                "at_position0": s.massive_pos0,
                "top_positions": [[p, c] for p, c in s.massive_positions.most_common(top_k)],
                "mean_ratio_pos0": s.ratio_sum_pos0 / s.sequences,
                "mean_ratio_rest": s.ratio_sum_rest / (s.tokens - s.sequences),
            }
        )
    ids = [
        {"id": i, "count": c, "text": tokenizer.decode([i]) if tokenizer is not None else None}
        for i, c in obs.massive_token_ids.most_common(top_k)
    ]
    return {"ratio": ratio, "per_state": per_state, "token_ids": ids}


def _attention(obs: DiagnosticsObserver) -> dict:
    """Sink statistics of the softmax-attention layers (`layers`: their indices; per-layer lists follow that
    order); `skipped`: the other layers and why (e.g. Gated DeltaNet); `map` None when no layer has softmax."""
    never = [i for i, a in obs.attention.items() if a is None]
    if never:
        raise RuntimeError(f"the attention of layers {never} was never called in the forward pass")
    layers = [a for a in obs.attention.values() if a is not None]  # all of them (`never` is empty)
    per_layer_map = [a.map_sum / (a.sequences * len(a.alpha_sum)) for a in layers]
    return {
        "layers": list(obs.attention),
        "skipped": [{"layer": i, "reason": why} for i, why in obs.attention_skipped.items()],
        "sink_rate": [(a.sink_count.sum() / (a.sequences * len(a.sink_count))).item() for a in layers],
        "alpha": [(a.alpha_sum / a.sequences).tolist() for a in layers],
        "first_token_mass": [(a.mass_sum / a.sequences).tolist() for a in layers],
        "first_token_mass_layer": [(a.mass_sum.mean() / a.sequences).item() for a in layers],
        "map": torch.stack(per_layer_map).mean(0).tolist() if layers else None,
    }


def _experts(obs: DiagnosticsObserver, top_k: int) -> dict:
    """Per fused experts module (MoE layer): routing load and per-expert input maxima (docs/diagnostics.md).

    `load[e]` = routed (token, slot) pairs of expert e / (tokens x k): sums to 1, 1/E when balanced;
    `token_fraction[e]` = fraction of tokens with e among their top-k = k x load[e], at most 1. Maxima are
    over the tokens routed to e (None for an expert that got none)."""
    out = {}
    for name, acc in obs.experts.items():
        layer = re.search(r"layers\.(\d+)\.", name)
        routed = acc.slots > 0
        down_top = acc.down_input_max.argmax(1)

        def per_expert(values: torch.Tensor, routed: torch.Tensor = routed) -> list[float | None]:
            return [v if r else None for v, r in zip(values.tolist(), routed.tolist())]

        load = acc.slots / (acc.tokens * acc.top_k)
        out[name] = {
            "layer": int(layer.group(1)) if layer else None,
            "num_experts": len(acc.slots),
            "top_k": acc.top_k,
            "tokens": acc.tokens,
            "load": load.tolist(),
            "token_fraction": (load * acc.top_k).tolist(),
            "max_load_ratio": (load.max() * len(load)).item(),
            "unrouted_experts": int((~routed).sum()),
            "gate_up_input_max": per_expert(acc.gate_up_input_max.amax(1)),
            "down_input_max": per_expert(acc.down_input_max.amax(1)),
            "down_input_top_channel": [int(c) if r else None for c, r in zip(down_top.tolist(), routed.tolist())],
            "down_input_top_experts": [
                {"expert": e, "max_abs": acc.down_input_max[e].max().item(), "channel": int(down_top[e])}
                for e in acc.down_input_max.amax(1).argsort(descending=True)[:top_k].tolist()
                if routed[e]
            ],
        }
    return out


def _input_norm_params(layer: nn.Module) -> dict[str, torch.Tensor | None]:
    """The decoder layer's input norm's weight and pre_scale as the function uses them (`_norm_param`)."""
    norm = getattr(layer, "input_layernorm", None)
    return {attr: _norm_param(norm, attr) for attr in ("weight", "pre_scale")}


def _norm_entries(model: nn.Module, names: list[str], top_k: int) -> list[dict]:
    """The parameters of the residual norms `names`; top dims by |value - neutral| (1 for scales, 0 for the DyT
    bias)."""
    out = []
    for name in names:
        norm = model.get_submodule(name)
        for param, neutral in NORM_PARAMS.items():
            v = _norm_param(norm, param)
            if v is None:
                continue
            if not bool(torch.isfinite(v).all()):
                raise NonFiniteStatisticsError(f"{name}.{param} holds non-finite values")
            entry: dict[str, Any] = {"name": name, "param": param}
            if param == "weight" and isinstance(norm, OFFSET_NORMS):
                entry["convention"] = "1 + w"  # the values are the scale 1 + w, not the stored w
            if v.numel() == 1 or neutral is None:
                out.append({**entry, "values": v.tolist()})
                continue
            dev = (v - neutral).abs()
            top = dev.argsort(descending=True)[:top_k].tolist()
            out.append(
                {
                    **entry,
                    "mean": v.mean().item(),
                    "std": v.std().item(),
                    "min": v.min().item(),
                    "max": v.max().item(),
                    "max_deviation": dev.max().item(),
                    "top_dims": [{"dim": j, "value": v[j].item()} for j in top],
                    "values": v.tolist(),
                }
            )
    return out


def _norm_param(norm: nn.Module | None, param: str) -> torch.Tensor | None:
    """A norm parameter as the function uses it, float32 1-D on CPU: the scale 1 + w of an offset norm
    (OFFSET_NORMS) for `weight`, the stored tensor otherwise; None when the norm has no such tensor."""
    value = getattr(norm, param, None)
    if not isinstance(value, torch.Tensor):
        return None
    v = value.detach().float().reshape(-1).cpu()
    return 1.0 + v if param == "weight" and isinstance(norm, OFFSET_NORMS) else v


def _gates(obs: DiagnosticsObserver, top_k: int) -> list[dict]:
    """GatedNorm gates sigmoid(...) per norm: mean over tokens and dims, and the most-closed dims."""
    out = []
    for name, g in obs.gates.items():
        mean = g.mean_abs  # gates are positive
        low = mean.argsort()[:top_k].tolist()
        out.append(
            {
                "name": name,
                "mean": mean.mean().item(),
                "lowest_dims": [{"dim": j, "mean_gate": mean[j].item()} for j in low],
            }
        )
    return out


def _linears(obs: DiagnosticsObserver, top_k: int) -> dict:
    out = {}
    for name, s in obs.linears.items():
        if s.channel_max is None:
            continue  # not called in the forward pass (e.g. an unused head)
        cm = s.channel_max
        top = cm.argsort(descending=True)[:top_k].tolist()
        out[name] = {
            "max_abs": s.moments.max_abs,
            "kurtosis": s.moments.kurtosis,
            "std": s.moments.std,
            "channel_max_ratio": (cm.max() / cm.median().clamp_min(1e-30)).item(),
            "top_channels": [{"channel": j, "max_abs": cm[j].item()} for j in top],
        }
    return out


def _summary(r: dict) -> dict:
    """Headline figures: the row a report table shows per checkpoint."""
    res, att = r["residual"], r["attention"]
    i_max = max(range(len(res["max_abs"])), key=res["max_abs"].__getitem__)
    massive = r["massive"]["per_state"]
    total = sum(m["count"] for m in massive)
    worst = {}
    for recipe, snr in r["quant_snr_db"].items():
        if snr:
            name = min(snr, key=snr.get)
            worst[recipe] = {"linear": name, "snr_db": snr[name], "mean_snr_db": sum(snr.values()) / len(snr)}
    body = {n: s for n, s in r["linears"].items() if n != "lm_head"}  # lm_head stays BF16; as zoo metrics
    linear_max = max(body.items(), key=lambda kv: kv[1]["max_abs"])
    softmax = len(att["sink_rate"])  # None below: no softmax-attention layer at all
    summary = {
        "max_residual": res["max_abs"][i_max],
        "max_residual_state": res["states"][i_max],
        "top_sink_dims": [d["dim"] for d in r["sink_dims"][:3]],
        "top_sink_ratio": r["sink_dims"][0]["ratio_to_median"],
        "softmax_layers": att["layers"],
        "attention_skipped_layers": [s["layer"] for s in att["skipped"]],
        "sink_rate_mean": sum(att["sink_rate"]) / softmax if softmax else None,
        "sink_rate_max": max(att["sink_rate"], default=None),
        "first_token_mass_mean": sum(att["first_token_mass_layer"]) / softmax if softmax else None,
        "massive_tokens": total,
        "massive_at_position0": sum(m["at_position0"] for m in massive),
        "max_linear_input": linear_max[1]["max_abs"],
        "max_linear_input_at": linear_max[0],
        "max_residual_kurtosis": max((k for k in res["kurtosis"] if not math.isnan(k)), default=float("nan")),
        "worst_snr": worst,
    }
    if r["experts"]:  # MoE: the most loaded expert (x E: 1 = balanced) and the largest expert input
        name, ex = max(r["experts"].items(), key=lambda kv: kv[1]["max_load_ratio"])
        top = max(
            ((n, t) for n, x in r["experts"].items() for t in x["down_input_top_experts"][:1]),
            key=lambda nt: nt[1]["max_abs"],
        )
        summary.update(
            {
                "max_expert_load_ratio": ex["max_load_ratio"],
                "max_expert_load_at": name,
                "unrouted_experts": sum(x["unrouted_experts"] for x in r["experts"].values()),
                "max_expert_down_input": top[1]["max_abs"],
                "max_expert_down_input_at": f"{top[0]}.{top[1]['expert']}.down_proj",
            }
        )
    return summary


def sensitivity_markdown(result: dict) -> str:
    """The per-projection-kind SNR table of one diagnosed checkpoint: one row per kind (most sensitive first,
    by the first recipe), per recipe "mean (min @ layer)" in dB (`quantkit.report.render.sensitivity_table`, as
    the study's report shows it)."""
    from quantkit.report.render import sensitivity_table

    return sensitivity_table(result["sensitivity"])


def _clean(x: Any) -> Any:
    """JSON-ready copy: tensors to lists, floats to 6 significant digits, NaN/Inf to None."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _clean(x.tolist())
    if isinstance(x, float):
        return float(f"{x:.6g}") if math.isfinite(x) else None
    return x


def summary_markdown(results: Sequence[dict]) -> str:
    """One Markdown row per diagnosed checkpoint: the headline figures (see docs/diagnostics.md)."""
    recipes = list(dict.fromkeys(k for r in results for k in r["summary"]["worst_snr"]))
    head = [
        "model",
        "max abs residual (state)",
        "top sink dims (x median)",
        "sink rate (mean / max)",
        "first-token mass",
        "massive tokens (pos 0)",
    ] + [f"worst SNR {k} (dB, layer)" for k in recipes]
    moe = any("max_expert_load_ratio" in r["summary"] for r in results)
    if moe:
        head += ["max expert load (x uniform)", "max expert down_proj input"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        s = r["summary"]
        name = Path(r["model"].get("path", r["model"]["architecture"])).name
        row = [
            name,
            f"{s['max_residual']:.3g} ({s['max_residual_state']})",
            f"{', '.join(map(str, s['top_sink_dims']))} ({s['top_sink_ratio']:.3g}x)",
            _sink_cell(s),
            "-" if s["first_token_mass_mean"] is None else f"{s['first_token_mass_mean']:.3f}",
            f"{s['massive_tokens']} ({s['massive_at_position0']})",
        ]
        for k in recipes:
            w = s["worst_snr"].get(k)
            row.append("-" if w is None else f"{_fmt_db(w['snr_db'])} ({w['linear'].removeprefix('model.')})")
        if moe and "max_expert_load_ratio" in s:
            row += [
                f"{s['max_expert_load_ratio']:.2f} ({s['max_expert_load_at'].removeprefix('model.')})",
                f"{s['max_expert_down_input']:.3g} ({s['max_expert_down_input_at'].removeprefix('model.')})",
            ]
        elif moe:
            row += ["-", "-"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _sink_cell(s: dict) -> str:
    """'mean / max' over the softmax layers; those layers named when others were skipped (hybrid models)."""
    if s["sink_rate_mean"] is None:
        return "- (no softmax layer)"
    cell = f"{s['sink_rate_mean']:.2f} / {s['sink_rate_max']:.2f}"
    if s["attention_skipped_layers"]:
        cell += f" (softmax layers {', '.join(map(str, s['softmax_layers']))})"
    return cell


def _fmt_db(v: float | None) -> str:
    return "exact" if v is None else f"{v:.1f}"


def write_diagnostics(result: dict, out_dir: str | Path) -> list[Path]:
    """Write diagnostics.json, summary.md and the figures (PNG and SVG) to out_dir, each file atomically."""
    from quantkit.diagnose.plots import write_figures

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        write_text_atomic(out_dir / "diagnostics.json", json.dumps(result, indent=1, allow_nan=False)),
        write_text_atomic(
            out_dir / "summary.md", summary_markdown([result]) + "\n\n" + sensitivity_markdown(result) + "\n"
        ),
    ]
    return paths + write_figures(result, out_dir)
