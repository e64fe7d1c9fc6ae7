"""Figures of a diagnostics result (matplotlib, Agg, no pyplot state), after the papers' figures.

- `outliers`: max |x| per layer of the residual stream and of each linear kind's input (log scale).
- `residual_heatmap`: mean |H_i^j| per residual state i x dimension j, dimensions sorted by H_avg^j
  (paper 000 Fig. 1/2); at most `HEATMAP_DIMS` dimensions are shown.
- `attention_map`: attention probabilities of the first N queries x keys, averaged over sequences, heads
  and softmax-attention layers (paper 000 Fig. 1, top row).
- `attention_sinks`: sink rate Sink_0^{0.3,l} and first-token mass per softmax-attention layer (paper 002
  Fig. 1); layers without softmax (Gated DeltaNet) are named as skipped.
- `norm_weights`: residual norm parameters per dimension, one line per norm (paper 000 Fig. 5-7).
- `quant_snr`: per-linear quantization SNR (dB) per recipe (expert matrices: `expert_snr`).
MoE models (fused routed experts) add:
- `expert_load`: routed load per expert x number of experts (1 = uniform), MoE layer x expert.
- `expert_maxima`: max |x| at each expert's gate/up input and down_proj input, MoE layer x expert (log colour).
- `expert_snr`: per MoE layer and projection, min and median over experts of the SNR per recipe.

`figures(result)` -> {name: Figure}; `figure_svgs(result)` -> {name: inline <svg> text for HTML};
`write_figures(result, out_dir)` -> PNG and SVG files, each written atomically.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from quantkit.formats.experts import EXPERT_MATRIX, EXPERT_PROJECTIONS

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

_RC: dict[RcKeyType, Any] = {"svg.hashsalt": "quantkit", "svg.fonttype": "none", "font.size": 8}
HEATMAP_DIMS = 256


def _outliers(r: dict) -> Figure:
    fig = Figure(figsize=(6.0, 3.4))
    ax = fig.add_subplot()
    res = r["residual"]["max_abs"]
    ax.plot(range(len(res)), res, "k-o", ms=3, label="residual H_i")
    kinds: dict[str, dict[int, float]] = {}
    for name, s in r["linears"].items():
        m = re.search(r"layers\.(\d+)\..*?([A-Za-z_]+)$", name)
        if m:
            kinds.setdefault(m.group(2), {})[int(m.group(1))] = s["max_abs"]
    for ex in r["experts"].values():  # max over the layer's experts (None: expert got no token)
        for key, kind in (("gate_up_input_max", "experts gate/up"), ("down_input_max", "experts down_proj")):
            values = [v for v in ex[key] if v is not None]
            if values and ex["layer"] is not None:
                kinds.setdefault(kind, {})[ex["layer"]] = max(values)
    for kind, by_layer in sorted(kinds.items()):
        xs = sorted(by_layer)
        ax.plot(xs, [by_layer[x] for x in xs], "-", marker=".", lw=1, label=f"{kind} input")
    ax.set_yscale("log")
    ax.set_xticks(range(len(res)))
    ax.set_xlabel("layer i (residual: input of layer i; last = final norm input)")
    ax.set_ylabel("max |x|")
    ax.set_title("Outliers: max |activation| per layer")
    ax.grid(lw=0.3)
    ax.legend(fontsize=6, ncols=2)
    return fig


def _residual_heatmap(r: dict) -> Figure:
    mean_abs = np.array(r["residual"]["mean_abs_per_dim"], dtype=float)  # (D+1, d)
    order = np.argsort(-mean_abs.mean(0))[:HEATMAP_DIMS]
    data = np.maximum(mean_abs[:, order], 1e-6)
    fig = Figure(figsize=(7.0, 2.6 + 0.08 * len(data)))
    ax = fig.add_subplot()
    im = ax.imshow(data, aspect="auto", cmap="viridis", norm=LogNorm(), interpolation="nearest")
    top = ", ".join(str(j) for j in order[:3])
    ax.set_xlabel(f"dimension rank by H_avg (top {len(order)} of {mean_abs.shape[1]}); dims ranked 1-3: {top}")
    ax.set_ylabel("residual state i")
    ax.set_yticks(range(len(data)))
    ax.set_title("Residual stream mean |h| (dims sorted, residual sinks on the left)")
    fig.colorbar(im, ax=ax, label="mean |h|")
    return fig


def _attention_map(r: dict) -> Figure:
    a = np.array(r["attention"]["map"], dtype=float)
    fig = Figure(figsize=(4.2, 3.6))
    ax = fig.add_subplot()
    im = ax.imshow(
        np.where(np.tril(np.ones_like(a)) > 0, a, np.nan), cmap="magma", vmin=0, vmax=1, interpolation="nearest"
    )
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(
        f"Attention, first {len(a)} tokens\n"
        f"(mean over sequences, heads, softmax layers {_layer_list(r['attention']['layers'])})"
    )
    fig.colorbar(im, ax=ax, label="probability")
    return fig


def _attention_sinks(r: dict) -> Figure:
    att = r["attention"]
    fig = Figure(figsize=(5.0, 3.0))
    ax = fig.add_subplot()
    x = np.arange(len(att["sink_rate"]))
    ax.bar(x - 0.2, att["sink_rate"], 0.4, label=f"sink rate (alpha > {r['settings']['sink_eps']})")
    ax.bar(x + 0.2, att["first_token_mass_layer"], 0.4, label="first-token mass")
    ax.set_ylim(0, 1.05)
    skipped = [s["layer"] for s in att["skipped"]]
    ax.set_xlabel(
        "layer" + (f" (softmax attention only; no softmax in layers {_layer_list(skipped)})" if skipped else "")
    )
    ax.set_xticks(x, [str(i) for i in att["layers"]])
    ax.set_title("Attention sinks per layer")
    ax.legend(fontsize=7)
    ax.grid(axis="y", lw=0.3)
    return fig


def _norm_weights(r: dict) -> Figure:
    params = [p for p in ("weight", "pre_scale") if any(n["param"] == p and "top_dims" in n for n in r["norms"])]
    fig = Figure(figsize=(7.0, 2.6 * len(params)))
    for k, param in enumerate(params):
        ax = fig.add_subplot(len(params), 1, k + 1)
        for n in (n for n in r["norms"] if n["param"] == param and "top_dims" in n):
            ax.plot(n["values"], lw=0.6, alpha=0.7)
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_ylabel(param)
        ax.set_title(f"Residual norm {param} per dimension (one line per norm)")
        ax.grid(lw=0.3)
    ax.set_xlabel("dimension")
    return fig


def _quant_snr(r: dict) -> Figure:
    snr = r["quant_snr_db"]
    names = sorted({n for v in snr.values() for n in v if not EXPERT_MATRIX.match(n)}, key=_layer_order)
    fig = Figure(figsize=(max(6.0, 0.12 * len(names)), 3.4))
    ax = fig.add_subplot()
    for recipe, values in snr.items():
        ax.plot(
            range(len(names)),
            [np.nan if values.get(n) is None else values[n] for n in names],
            ".-",
            lw=0.8,
            label=recipe,
        )
    ax.set_xticks(range(len(names)), [n.removeprefix("model.") for n in names], rotation=90, fontsize=5)
    ax.set_ylabel("SNR (dB)")
    ax.set_title("Quantization SNR per linear (fake-quant x and W vs float product)")
    ax.grid(lw=0.3)
    ax.legend(fontsize=7)
    return fig


def _moe_rows(r: dict) -> tuple[list[dict], list[str]]:
    """The MoE layers' expert entries in layer order and their row labels."""
    rows = sorted(r["experts"].values(), key=lambda e: (e["layer"] is None, e["layer"]))
    return rows, [f"layer {e['layer']}" for e in rows]


def _expert_load(r: dict) -> Figure:
    rows, labels = _moe_rows(r)
    data = np.array([np.array(e["load"]) * e["num_experts"] for e in rows], dtype=float)  # 1 = uniform
    fig = Figure(figsize=(max(4.5, 0.12 * data.shape[1] + 2.5), 1.6 + 0.3 * len(rows)))
    ax = fig.add_subplot()
    im = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0, interpolation="nearest")
    ax.set_yticks(range(len(rows)), labels)
    ax.set_xlabel(f"expert (top-{rows[0]['top_k']} of {data.shape[1]})")
    ax.set_title("Expert load: share of routed token slots x num experts (1 = uniform)")
    fig.colorbar(im, ax=ax, label="load x E")
    return fig


def _expert_maxima(r: dict) -> Figure:
    rows, labels = _moe_rows(r)
    fig = Figure(figsize=(max(5.0, 0.12 * len(rows[0]["load"]) + 3.0), 2.2 + 0.6 * len(rows)))
    for k, (key, what) in enumerate((("gate_up_input_max", "gate/up input"), ("down_input_max", "down_proj input"))):
        ax = fig.add_subplot(2, 1, k + 1)
        data = np.array([[np.nan if v is None else max(v, 1e-6) for v in e[key]] for e in rows], dtype=float)
        im = ax.imshow(data, aspect="auto", cmap="viridis", norm=LogNorm(), interpolation="nearest")
        ax.set_yticks(range(len(rows)), labels)
        ax.set_title(f"Experts' {what}: max |x| (routed tokens; blank: none)")
        fig.colorbar(im, ax=ax, label="max |x|")
    ax.set_xlabel("expert")
    return fig


def _expert_snr(r: dict) -> Figure:
    summaries = {recipe: s for recipe, s in r["expert_snr_db"].items() if s}
    fig = Figure(figsize=(7.5, 2.8))
    for k, proj in enumerate(EXPERT_PROJECTIONS):
        ax = fig.add_subplot(1, len(EXPERT_PROJECTIONS), k + 1)
        for n, (recipe, per_module) in enumerate(summaries.items()):
            rows = sorted((r["experts"][m]["layer"], v[proj]) for m, v in per_module.items() if proj in v)
            xs = [layer for layer, _ in rows]
            colour = f"C{n}"
            ax.plot(xs, [v["median"] for _, v in rows], "-", marker=".", color=colour, lw=0.8, label=f"{recipe} median")
            ax.plot(
                xs, [v["min"] for _, v in rows], "--", marker="v", ms=3, color=colour, lw=0.8, label=f"{recipe} min"
            )
        ax.set_title(f"experts' {proj}")
        ax.set_xlabel("layer")
        ax.grid(lw=0.3)
    fig.axes[0].set_ylabel("SNR (dB) over experts")
    fig.axes[0].legend(fontsize=5)
    fig.suptitle("Quantization SNR per expert matrix: min and median over the layer's experts")
    return fig


def _layer_list(layers: list[int]) -> str:
    return ", ".join(map(str, layers))


def _layer_order(name: str) -> tuple[int, str]:
    m = re.search(r"layers\.(\d+)\.", name)
    return (int(m.group(1)) if m else 10**9, name)


_FIGURES = {
    "outliers": _outliers,
    "residual_heatmap": _residual_heatmap,
    "attention_map": _attention_map,
    "attention_sinks": _attention_sinks,
    "norm_weights": _norm_weights,
    "quant_snr": _quant_snr,
    "expert_load": _expert_load,
    "expert_maxima": _expert_maxima,
    "expert_snr": _expert_snr,
}


def _has_data(name: str, result: dict) -> bool:
    """Whether figure `name` has anything to show (no softmax layer, no recipe, no MoE layer: left out)."""
    if name in ("attention_map", "attention_sinks"):
        return bool(result["attention"]["layers"])
    if name == "quant_snr":
        return any(not EXPERT_MATRIX.match(n) for v in result["quant_snr_db"].values() for n in v)
    if name == "norm_weights":
        return any("top_dims" in n for n in result["norms"])
    if name in ("expert_load", "expert_maxima"):
        return bool(result["experts"])
    if name == "expert_snr":
        return any(result["expert_snr_db"].values())
    return True


def figures(result: dict) -> dict[str, Figure]:
    """{name: Figure} for a `diagnose` result; figures without data (`_has_data`) are left out."""
    with matplotlib.rc_context(_RC):
        out = {}
        for name, make in _FIGURES.items():
            if not _has_data(name, result):
                continue
            fig = make(result)
            FigureCanvasAgg(fig)
            fig.set_layout_engine("tight")
            out[name] = fig
        return out


def figure_svgs(result: dict) -> dict[str, str]:
    """{name: '<svg ...>...</svg>'} ready to inline into HTML (XML prolog dropped, no timestamp)."""
    from quantkit.report.plots import inline_svg

    with matplotlib.rc_context(_RC):
        return {name: inline_svg(fig) for name, fig in figures(result).items()}


def write_figures(result: dict, out_dir: str | Path) -> list[Path]:
    """Write <name>.png (150 dpi) and <name>.svg per figure to out_dir; returns the paths."""
    out_dir = Path(out_dir)
    paths = []
    for name, fig in figures(result).items():
        for ext, kwargs in (("png", {"dpi": 150}), ("svg", {"metadata": {"Date": None}})):
            path = out_dir / f"{name}.{ext}"
            tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.{ext}")
            with matplotlib.rc_context(_RC):
                fig.savefig(tmp, format=ext, **kwargs)
            os.replace(tmp, path)
            paths.append(path)
    return paths
