"""quantkit's Triton kernels on real activations and weights of a trained model (outliers included).

The kernel tests and benchmarks use random data; trained models have massive activation outliers (SmolLM2's
residual stream reaches ~2.5e4, its down_proj inputs ~3e3). Two steps:

  capture  (CPU, the project's venv): run ~512 tokens of the held-out State of the Union text
           (`quantkit.data.heldout_windows`) through a local bf16 HF checkpoint and save, for a few decoder
           layers, the input (T, K) and the weight (N, K) of every Linear (q/k/v/o, gate/up/down), bf16, in
           one safetensors file (inputs shared by several projections stored once), metadata in its header
           and in a .json beside it. Default layers: the one whose down_proj input has the largest max |x|,
           then the last, first and middle ones, as many as fit --max-mb (default 24 MB: SmolLM2-135M gets
           2 layers, Qwen2.5-0.5B 1 (38 MB, its minimum), so both files and the checkout stay under the 64 MiB
           a device call carries).
  check    for every recorded (layer, projection), token count M and scheme of `quantkit.kernels.schemes`
           (fp8_block: 128x128 FP8 weights, per-token FP8 activations; nvfp4: W4A4, two-stage scales):
           - weights encoded by the pure-torch reference (`Scheme.encode`, on the CPU);
           - activations quantized by the Triton kernel and by the reference (`Scheme.quantize_activation`,
             CPU): bit-exact, every operand compared on its bits (mismatching elements counted);
           - the Triton GEMM against the float32 product of the dequantized operands, with the bound of
             tests/test_kernels_gemm.py (err/tol <= 1; natively the FP8 tensor-core accumulation term too);
           - informational: ||y - y0|| / ||y0||, y0 = the unquantized product of the bf16 operands (float32):
             what the format costs on real data;
           - on CUDA: times (triton.testing.do_bench medians) of our quantizer, our GEMM and torch's bf16 mm;
           - --online-hadamard: each down_proj once more as a rotated checkpoint serves it (proj "down_proj+H"):
             x and w's rows through `quantkit.formats.hadamard.block_hadamard` first (the device's transform of x
             bit-equal to the CPU's), rel err still against the unrotated product, and the transform's time;
             the fused quantizer (Hadamard inside the kernel, `quantize(x, hadamard=b)`, what serving runs)
             bit-exact with the reference on the transformed x, and its time ("fused us") against the torch
             transform + quantizer ("Hadamard us" + "quant us").
           Without CUDA the kernels run through the Triton interpreter (`--quick`: the layer with the
           largest max |x|, M = 16).
           Writes <out>/trained_kernels_<device>_<date>[_quick].{json,md}, prints a summary table last and
           exits 1 if any bit-exactness or bound check fails.

quantkit need not be installed: when `quantkit.kernels` does not import, this script puts a temporary tree of
links on sys.path (quantkit/ plus kernels/ as quantkit/kernels, as pyproject's package-dir maps it; what
benchmarks/gpu_all.sh does). From the repository root:

  .venv/bin/python benchmarks/trained_kernels.py capture --model-dir /tmp/qkmodels/smollm2-135m-instruct \\
      --out .trained_kernels/smollm2-135m-instruct.safetensors
  python3 benchmarks/trained_kernels.py check --data .trained_kernels/*.safetensors --out "$OUT"
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before triton is imported: kernels run through the CPU interpreter
    os.environ["TRITON_INTERPRET"] = "1"

REPO = Path(__file__).resolve().parent.parent
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
META_KEY = "trained_kernels"  # the safetensors header's metadata entry holding the JSON metadata
FP8_MMA_REL = 128 * 2.0**-13  # tests/test_kernels_gemm.py: Hopper's FP8 MMA accumulates in e8m13, per 128-wide block
QUICK_TOKENS = 16


def ensure_quantkit() -> None:
    """Make `quantkit.kernels` importable from this checkout when quantkit is not installed: a temporary tree
    of links laid out as pyproject.toml's package-dir maps it (as benchmarks/gpu_all.sh builds), removed at exit."""
    try:
        import quantkit.kernels  # noqa: F401

        return
    except ImportError:
        pass
    site = Path(tempfile.mkdtemp(prefix="quantkit-site-"))
    atexit.register(shutil.rmtree, site, ignore_errors=True)
    (site / "quantkit").mkdir()
    for f in (REPO / "quantkit").iterdir():
        (site / "quantkit" / f.name).symlink_to(f)
    for d in ("kernels", "pipelines", "evals"):
        (site / "quantkit" / d).symlink_to(REPO / d)
    sys.path.insert(0, str(site))
    for name in [m for m in sys.modules if m == "quantkit" or m.startswith("quantkit.")]:
        del sys.modules[name]


ensure_quantkit()

import bench_gemm  # noqa: E402  (benchmarks/ is sys.path[0]: err/tol's conventions, timing, result files)
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from quantkit.formats.hadamard import block_hadamard, online_block  # noqa: E402
from quantkit.formats.schemes import FP8_BLOCK, SCHEMES, Scheme  # noqa: E402
from quantkit.kernels.schemes import KERNELS  # noqa: E402

# --- capture ----------------------------------------------------------------------------------------------


def record_linear_inputs(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[dict, dict]:
    """One forward pass of input_ids (1, T). Returns ({(layer, proj): input (T, K) bf16}, {(layer, proj):
    weight (N, K)}) for every decoder layer; projections fed the same tensor share one recorded input object."""
    layers = model.model.layers
    inputs: dict[tuple[int, str], torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}  # id of a hooked input -> its recorded copy (the originals are kept alive)
    keep: list[torch.Tensor] = []
    handles = []
    weights = {}
    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            proj = name.rsplit(".", 1)[-1]
            if proj not in PROJECTIONS or not isinstance(module, torch.nn.Linear):
                continue
            weights[(i, proj)] = module.weight.detach()

            def hook(_module, args, key=(i, proj)):
                x = args[0]
                if id(x) not in seen:
                    keep.append(x)
                    seen[id(x)] = x.detach().reshape(-1, x.shape[-1]).to(torch.bfloat16).clone()
                inputs[key] = seen[id(x)]

            handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.inference_mode():
            model(input_ids=input_ids)
    finally:
        for h in handles:
            h.remove()
    return inputs, weights


def choose_layers(inputs: dict, weights: dict, num_layers: int, max_mb: float) -> list[int]:
    """Layers by priority (largest max |down_proj input|, last, first, middle), as many as fit max_mb (>= 1)."""
    down = {i: float(x.abs().max()) for (i, proj), x in inputs.items() if proj == "down_proj"}
    priority = list(dict.fromkeys([max(down, key=down.get), num_layers - 1, 0, num_layers // 2]))
    chosen, total = [], 0.0
    for i in priority:
        size = layer_bytes(inputs, weights, i) / 1e6
        if chosen and total + size > max_mb:
            continue
        chosen.append(i)
        total += size
    return sorted(chosen)


def layer_bytes(inputs: dict, weights: dict, layer: int) -> int:
    """Bytes one layer's recorded tensors take (shared inputs once)."""
    unique = {id(x): x for (i, _), x in inputs.items() if i == layer}
    tensors = [*unique.values(), *(w for (i, _), w in weights.items() if i == layer)]
    return sum(t.numel() * t.element_size() for t in tensors)


def capture(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.data import heldout_windows

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16).eval()
    input_ids = heldout_windows(tokenizer, 1, args.tokens)
    inputs, weights = record_linear_inputs(model, input_ids)
    num_layers = len(model.model.layers)
    layers = sorted(args.layers) if args.layers else choose_layers(inputs, weights, num_layers, args.max_mb)

    tensors: dict[str, torch.Tensor] = {}
    entries = []
    names: dict[int, str] = {}  # id of a recorded input -> its tensor name in the file
    for i in layers:
        for proj in PROJECTIONS:
            if (i, proj) not in weights:
                continue
            x, w = inputs[(i, proj)], weights[(i, proj)].to(torch.bfloat16).contiguous()
            if id(x) not in names:
                names[id(x)] = f"layers.{i}.{proj}.input"
                tensors[names[id(x)]] = x
            tensors[f"layers.{i}.{proj}.weight"] = w
            entries.append(
                {
                    "layer": i,
                    "proj": proj,
                    "input": names[id(x)],
                    "weight": f"layers.{i}.{proj}.weight",
                    "N": w.shape[0],
                    "K": w.shape[1],
                    "x_absmax": float(x.float().abs().max()),
                    "w_absmax": float(w.float().abs().max()),
                }
            )
    meta = {
        "model": Path(args.model_dir).name,
        "model_dir": str(args.model_dir),
        "model_type": model.config.model_type,
        "num_layers": num_layers,
        "layers": layers,
        "tokens": args.tokens,
        "text": "quantkit.data.heldout_windows(tokenizer, 1, tokens): held-out State of the Union speeches",
        "down_proj_input_absmax_by_layer": {
            i: round(float(x.abs().max()), 2) for (i, proj), x in sorted(inputs.items()) if proj == "down_proj"
        },
        "tensors": entries,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out), metadata={META_KEY: json.dumps(meta)})
    args.out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1e6:.1f} MB, layers {layers} of {num_layers}, {args.tokens} tokens) and .json")
    for e in entries:
        print(
            f"  layer {e['layer']:>2} {e['proj']:<9} N={e['N']:>5} K={e['K']:>5} "
            f"max|x|={e['x_absmax']:.4g} max|w|={e['w_absmax']:.4g}"
        )
    return 0


# --- check ------------------------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's elements as integers of the same width (a bit-exact comparison, -0.0 and NaN payloads included)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def mismatches(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> int:
    """Elements whose bits differ over all operands (all of an operand's elements if shapes or dtypes differ)."""
    total = 0
    for g, w in zip(got, want, strict=True):
        g = g.cpu()
        if g.shape != w.shape or g.dtype != w.dtype:
            total += max(g.numel(), w.numel())
        else:
            total += int((bits(g) != bits(w)).sum())
    return total


def err_over_tol(y: torch.Tensor, x_deq: torch.Tensor, w_deq: torch.Tensor, fp8_mma: bool) -> float:
    """max |y - ref| / tol, ref = x_deq @ w_deq.T (float32): tests/test_kernels_gemm.py's bound for a bf16
    output, tol = 2**-8 |ref| + K 2**-21 S (S = |x_deq| @ |w_deq|.T; bench_gemm.err_over_tol), plus
    FP8_MMA_REL * S where fp8_mma (an FP8 GEMM run natively: the tests add it under QUANTKIT_NATIVE_KERNELS=1)."""
    if not fp8_mma:
        return bench_gemm.err_over_tol(y, x_deq, w_deq)
    ref = x_deq @ w_deq.T
    summed = x_deq.abs() @ w_deq.abs().T
    tol = 2.0**-8 * ref.abs() + x_deq.shape[1] * 2.0**-21 * summed + FP8_MMA_REL * summed
    return float(((y.float() - ref).abs() / tol.clamp_min(torch.finfo(torch.float32).tiny)).max())


def check_case(scheme: Scheme, x: torch.Tensor, w: torch.Tensor, device: torch.device, hadamard: int = 0) -> dict:
    """x (M, K) bf16 and w (N, K) bf16 on the CPU -> one result row (see the module docstring). hadamard > 0: the
    rotated checkpoint's online transform with that block (`quantkit.formats.hadamard.block_hadamard`) applied to x
    (on the device: its bits must equal the CPU's, `hadamard_mismatches`) and to w's rows (float32) first; y0 stays
    the unrotated product (x H (w H)^T = x w^T)."""
    kernels, native = KERNELS[scheme.name], device.type == "cuda"
    xd = x_raw = x.to(device)
    y0 = x.float() @ w.float().T
    row: dict = {}
    if hadamard:
        x, w = block_hadamard(x, hadamard), block_hadamard(w, hadamard)
        xd = block_hadamard(xd, hadamard)
        row["hadamard_mismatches"] = mismatches((xd,), (x,))
    encoded = scheme.encode(w, "trained")
    weight = [t.to(device) for t in encoded.values()]  # `scheme.tensors` order
    w_deq = scheme.decode(encoded, w.shape[1])
    got = kernels.quantize(xd, None)
    want = scheme.quantize_activation(x)
    y = kernels.gemm(*got, *weight, None, out_dtype=torch.bfloat16).cpu()
    if hadamard:
        fused = kernels.quantize(x_raw, None, hadamard=hadamard)
        row["fused_mismatches"] = mismatches(fused, want)
    row |= {
        "act_mismatches": mismatches(got, want),
        "act_elements": sum(t.numel() for t in want),
        "err_over_tol": err_over_tol(y, scheme.fake_quant_activation(x), w_deq, fp8_mma=native and scheme is FP8_BLOCK),
        "rel_err_vs_bf16": float((y.float() - y0).norm() / y0.norm().clamp_min(1e-30)),
    }
    if native:
        wd = w.to(device, torch.bfloat16)
        row["quant_us"] = 1e3 * bench_gemm.time_ms(lambda: kernels.quantize(xd, None), True)
        gemm = lambda: kernels.gemm(*got, *weight, None, out_dtype=torch.bfloat16)  # noqa: E731
        row["gemm_us"] = 1e3 * bench_gemm.time_ms(gemm, True)
        row["bf16_us"] = 1e3 * bench_gemm.time_ms(lambda: xd.to(torch.bfloat16) @ wd.T, True)
        row["gemm_vs_bf16"] = row["bf16_us"] / row["gemm_us"]
        if hadamard:
            xb = x.to(device, torch.bfloat16)
            row["hadamard_us"] = 1e3 * bench_gemm.time_ms(lambda: block_hadamard(xb, hadamard), True)
            row["fused_us"] = 1e3 * bench_gemm.time_ms(lambda: kernels.quantize(xb, None, hadamard=hadamard), True)
    row["ok"] = (
        row["act_mismatches"] == 0
        and row["err_over_tol"] <= 1.0
        and not row.get("hadamard_mismatches")
        and not row.get("fused_mismatches")
    )
    return row


def load(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A capture file -> (metadata, tensors by name), on the CPU."""
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()[META_KEY])
        return meta, {name: f.get_tensor(name) for name in f.keys()}


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        *bench_gemm.record_head("Triton kernels on trained-model tensors", meta),
        f"- data: {', '.join(meta['data'])}",
        "- act mism: activation elements whose bits differ between the Triton quantizer (and, on down_proj+H rows, the"
        " fused Hadamard quantizer) and the reference (must be 0);"
        " err/tol: GEMM vs the dequantized float32 product, bound of tests/test_kernels_gemm.py"
        f"{' + FP8 MMA term' if meta['fp8_mma_term'] else ''} (<= 1); rel err: ||y - y0|| / ||y0||, y0 the"
        " unquantized bf16 operands' product (informational); times: " + meta["timing"],
        "",
        "| model | layer | proj | M | N | K | max\\|x\\| | scheme | act mism | err/tol | rel err "
        "| quant us | gemm us | bf16 us | Hadamard us | fused us | gemm vs bf16 | ok |",
        "|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        t = [f"{r[c]:.1f}" if c in r else "-" for c in ("quant_us", "gemm_us", "bf16_us", "hadamard_us", "fused_us")]
        vs = f"{r['gemm_vs_bf16']:.2f}x" if "gemm_vs_bf16" in r else "-"
        lines.append(
            f"| {r['model']} | {r['layer']} | {r['proj']} | {r['M']} | {r['N']} | {r['K']} "
            f"| {r['x_absmax']:.4g} | {r['scheme']} | {r['act_mismatches'] + r.get('fused_mismatches', 0)} "
            f"| {r['err_over_tol']:.3f} "
            f"| {r['rel_err_vs_bf16']:.4f} "
            f"| {' | '.join(t)} | {vs} | {'yes' if r['ok'] else '**NO**'} |"
        )
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    """One line per (model, layer, scheme, M): worst err/tol, total mismatches, rel err range, geomean speed."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["layer"], r["scheme"], r["M"]), []).append(r)
    lines = [
        "model | layer | scheme | M | max|x| | act mism | max err/tol | rel err min-max | gemm vs bf16 (geomean) | ok",
        "---|---:|---|---:|---:|---:|---:|---|---:|---",
    ]
    for (model, layer, scheme, m), rs in groups.items():
        speed = [r["gemm_vs_bf16"] for r in rs if "gemm_vs_bf16" in r]
        geo = f"{math.exp(sum(map(math.log, speed)) / len(speed)):.2f}x" if speed else "-"
        lines.append(
            f"{model} | {layer} | {scheme} | {m} | {max(r['x_absmax'] for r in rs):.4g} "
            f"| {sum(r['act_mismatches'] + r.get('fused_mismatches', 0) for r in rs)} "
            f"| {max(r['err_over_tol'] for r in rs):.3f} "
            f"| {min(r['rel_err_vs_bf16'] for r in rs):.4f}-{max(r['rel_err_vs_bf16'] for r in rs):.4f} "
            f"| {geo} | {'yes' if all(r['ok'] for r in rs) else 'NO'}"
        )
    return "\n".join(lines)


def check(args: argparse.Namespace) -> int:
    device = bench_gemm.bench_device("trained_kernels", args.quick)
    if device is None:
        return 2
    meta = {
        **bench_gemm.metadata(device, args.quick),
        "data": [str(p) for p in args.data],
        "fp8_mma_term": device.type == "cuda",
    }
    if device.type != "cuda":
        meta["timing"] = "none (interpreter: not timed)"
    rows: list[dict] = []
    for path in args.data:
        info, tensors = load(path)
        quick_layer = max(info["tensors"], key=lambda e: e["x_absmax"])["layer"]  # the largest outliers
        entries = [e for e in info["tensors"] if not args.quick or e["layer"] == quick_layer]
        for e in entries:
            x_all, w = tensors[e["input"]], tensors[e["weight"]]
            ms = [QUICK_TOKENS] if args.quick else sorted({min(m, len(x_all)) if m else len(x_all) for m in args.m})
            for m in ms:
                x = x_all[:m].contiguous()
                print(
                    f"{info['model']} layer {e['layer']} {e['proj']} M={m} N={e['N']} K={e['K']}",
                    file=sys.stderr,
                    flush=True,
                )
                blocks = [0, online_block(e["K"])] if args.online_hadamard and e["proj"] == "down_proj" else [0]
                for scheme, block in ((s, b) for s in SCHEMES.values() for b in blocks):
                    row = {
                        "model": info["model"],
                        "layer": e["layer"],
                        "proj": e["proj"] + ("+H" if block else ""),
                        "M": m,
                        "N": e["N"],
                        "K": e["K"],
                        "x_absmax": float(x.float().abs().max()),
                        "w_absmax": e["w_absmax"],
                        "scheme": scheme.name,
                    }
                    with torch.inference_mode():
                        rows.append({**row, **check_case(scheme, x, w, device, block)})
            bench_gemm.write_results(args.out, "trained_kernels", meta, rows, markdown(meta, rows), final=False)
    bench_gemm.write_results(args.out, "trained_kernels", meta, rows, markdown(meta, rows))
    failed = [r for r in rows if not r["ok"]]
    print("\n" + summary(rows))
    failures = [(r["model"], r["layer"], r["proj"], r["M"], r["scheme"]) for r in failed]
    print(
        f"\n{len(rows) - len(failed)} of {len(rows)} cases passed (bit-exact activations, err/tol <= 1)"
        + (f"; FAILED: {failures}" if failed else "")
    )
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("capture", help="record Linear inputs and weights of a trained model (CPU)")
    c.add_argument("--model-dir", type=Path, required=True, help="a local HF checkpoint (bf16)")
    c.add_argument("--out", type=Path, required=True, help="the .safetensors file to write (a .json beside it)")
    c.add_argument("--layers", type=int, nargs="+", help="decoder layers (default: see the module docstring)")
    c.add_argument("--tokens", type=int, default=512)
    c.add_argument("--max-mb", type=float, default=24.0, help="size budget of the default layer choice (MB)")
    k = sub.add_parser("check", help="check the Triton kernels on captured tensors")
    k.add_argument("--data", type=Path, nargs="+", required=True)
    k.add_argument("--out", type=Path, required=True)
    k.add_argument("--m", type=int, nargs="+", default=[16, 0], help="token counts (first M rows; 0: all)")
    k.add_argument(
        "--quick",
        action="store_true",
        help=f"the recorded layer with the largest max |x|, M = {QUICK_TOKENS} (the only mode without CUDA)",
    )
    k.add_argument(
        "--online-hadamard",
        action="store_true",
        help="also each down_proj with a rotated checkpoint's online block Hadamard (proj 'down_proj+H')",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return capture(args) if args.command == "capture" else check(args)


if __name__ == "__main__":
    sys.exit(main())
