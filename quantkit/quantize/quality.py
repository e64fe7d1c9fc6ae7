"""Quality of a quantized checkpoint against its source, before any serving.

- Per-layer quantization SNR (dB) of every quantized Linear: the layer's own output error on the
  REFERENCE model's inputs, 10 log10(sum y^2 / sum (y - y_q)^2), y = x W^T and y_q = fq(x) W_q^T
  (`quantkit.metrics.snr_db`, energies summed in float64).
  For SmoothQuant checkpoints the reference is the source with the same SmoothQuant folded in (recomputed
  from the recorded settings; function-preserving, so KL is unaffected), so that x and W match W_q.
- Whole-model KL(ref || quantized) of the next-token distributions, mean over held-out tokens (nats;
  `quantkit.metrics.kl_divergence`, float64).

    quantkit quality MODEL_DIR QUANTIZED_DIR [QUANTIZED_DIR ...]   -> markdown table (+ --json)
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantkit.models  # noqa: F401
from quantkit.calibrate import smooth_model
from quantkit.checkpoints import check_checkpoint_dir
from quantkit.data import heldout_windows
from quantkit.metrics import energy, kl_divergence, snr_db
from quantkit.quantize.fake_quant import load_fake_quant_model, read_quantization_config


@torch.no_grad()
def quality(reference_dir: str | Path, quantized_dir: str | Path, tokens: torch.Tensor) -> dict:
    """{'recipe', 'kl', 'layer_snr_db': {name: dB}, 'min_snr_db', 'mean_snr_db'} on token windows (N, T)."""
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    qc = read_quantization_config(quantized_dir)
    if qc["smoothquant"]:
        tokenizer = AutoTokenizer.from_pretrained(reference_dir)
        smooth_model(reference, tokenizer=tokenizer, progress=False, **qc["smoothquant"])
    quantized = load_fake_quant_model(quantized_dir)
    modules = dict(reference.named_modules())  # expert matrices of fused experts are no modules: their SNR is
    names = [n for n in qc["quantized_modules"] if n in modules]  # the per-expert diagnostics' (not here)
    signal = dict.fromkeys(names, 0.0)
    noise = dict.fromkeys(names, 0.0)
    hooks = []
    for name in names:
        ref_layer, q_layer = reference.get_submodule(name), quantized.get_submodule(name)

        def hook(_, args, out, name=name, q_layer=q_layer):
            signal[name] += energy(out)
            noise[name] += energy(q_layer(args[0]) - out)

        hooks.append(ref_layer.register_forward_hook(hook))
    kl_sum, count = 0.0, 0
    for window in tokens.split(4):
        kl = kl_divergence(reference(window).logits, quantized(window).logits)
        kl_sum += kl.sum().item()
        count += kl.numel()
    for h in hooks:
        h.remove()
    snr = {n: snr_db(signal[n], noise[n]) for n in names}
    return {
        "recipe": qc["recipe"],
        "kl": kl_sum / count,
        "layer_snr_db": snr,
        "min_snr_db": min(snr.values()),
        "mean_snr_db": sum(snr.values()) / len(snr),
    }


def quality_table(reference_dir: str | Path, quantized_dirs: list[str | Path], num_sequences: int = 16, seq_len: int = 256) -> tuple[str, list[dict]]:
    """Markdown table (one row per quantized checkpoint) and the per-checkpoint dicts, on held-out text."""
    for model_dir in (reference_dir, *quantized_dirs):  # every input, before any model is loaded
        check_checkpoint_dir(model_dir)
    for model_dir in quantized_dirs:
        read_quantization_config(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(reference_dir)
    tokens = heldout_windows(tokenizer, num_sequences, seq_len)
    rows = [quality(reference_dir, d, tokens) for d in quantized_dirs]
    lines = ["| recipe | KL vs source (nats/token) | min layer SNR (dB) | mean layer SNR (dB) | worst layer |", "|---|---|---|---|---|"]
    for r in rows:
        worst = min(r["layer_snr_db"], key=r["layer_snr_db"].get)
        lines.append(f"| {r['recipe']} | {r['kl']:.2e} | {r['min_snr_db']:.1f} | {r['mean_snr_db']:.1f} | {worst} |")
    return "\n".join(lines), rows
