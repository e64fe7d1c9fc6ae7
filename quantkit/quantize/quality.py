"""Quality of a quantized checkpoint against its source, before any serving.

- Per-layer quantization SNR (dB) of every quantized Linear: the layer's own output error on the
  REFERENCE model's inputs, 10 log10(sum y^2 / sum (y - y_q)^2), y = x W^T and y_q = fq(x) W_q^T
  (`quantkit.metrics.snr_db`, energies summed in float64).
- The same per quantized expert matrix `<experts>.<e>.<proj>` of fused routed experts (MoE), on the tokens
  the reference router sends to expert e (`quantkit.quantize.routed_experts`): gate_proj / up_proj read the
  block's input x, down_proj reads h = act(x gate_e^T) * (x up_e^T) of the reference; x and h are
  fake-quantized as the quantized checkpoint's experts do (`FakeQuantExperts`). An expert no token reaches has
  no SNR. Summarized per experts module and projection as min / median over experts (`expert_snr_db`, the
  second table).
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
from quantkit.formats.experts import EXPERT_PROJECTIONS, expert_matrices, fused_experts_modules
from quantkit.metrics import energy, kl_divergence, snr_db
from quantkit.quantize.fake_quant import FakeQuantExperts, load_fake_quant_model, read_quantization_config
from quantkit.quantize.routed_experts import projection_outputs, routed_expert_passes, summarize_expert_snr


KL_POSITIONS = 64  # positions whose float64 log-softmaxes `kl_divergence` holds at once


@torch.no_grad()
def quality(reference_dir: str | Path, quantized_dir: str | Path, tokens: torch.Tensor) -> dict:
    """{'recipe', 'kl', 'layer_snr_db': {name: dB}, 'min_snr_db', 'mean_snr_db', 'expert_snr_db'} on token
    windows (N, T); layer_snr_db holds Linears and expert matrices, min / mean are over all of them."""
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    qc = read_quantization_config(quantized_dir)
    if qc["smoothquant"]:
        tokenizer = AutoTokenizer.from_pretrained(reference_dir)
        smooth_model(reference, tokenizer=tokenizer, progress=False, **qc["smoothquant"])
    quantized = load_fake_quant_model(quantized_dir)
    modules = dict(reference.named_modules())  # expert matrices of fused experts are no modules (below)
    names = [n for n in qc["quantized_modules"] if n in modules]
    signal = dict.fromkeys(names, 0.0)
    noise = dict.fromkeys(names, 0.0)
    hooks = []
    quantized_set = set(qc["quantized_modules"])
    for name, ref_experts in fused_experts_modules(reference).items():
        q_experts = quantized.get_submodule(name)
        if isinstance(q_experts, FakeQuantExperts):  # else none of its matrices is quantized
            hooks.append(ref_experts.register_forward_hook(
                _experts_snr_hook(name, q_experts, quantized_set, signal, noise), with_kwargs=True))
    for name in names:
        ref_layer, q_layer = reference.get_submodule(name), quantized.get_submodule(name)

        def hook(_, args, out, name=name, q_layer=q_layer):
            signal[name] += energy(out)
            noise[name] += energy(q_layer(args[0]) - out)

        hooks.append(ref_layer.register_forward_hook(hook))
    kl_sum, count = 0.0, 0
    for window in tokens.split(1):  # one window's vocabulary-sized logits at a time, KL over position chunks
        ref_logits, test_logits = reference(window).logits, quantized(window).logits
        for a, b in zip(ref_logits.split(KL_POSITIONS, dim=1), test_logits.split(KL_POSITIONS, dim=1)):
            kl = kl_divergence(a, b)  # float64 copies of (1, KL_POSITIONS, V): ~0.1 GB at V = 152k
            kl_sum += kl.sum().item()
            count += kl.numel()
    for h in hooks:
        h.remove()
    snr = {n: snr_db(signal[n], noise[n]) for n in signal}  # expert matrices: those some token reached
    return {
        "recipe": qc["recipe"],
        "kl": kl_sum / count,
        "layer_snr_db": snr,
        "min_snr_db": min(snr.values()),
        "mean_snr_db": sum(snr.values()) / len(snr),
        "expert_snr_db": summarize_expert_snr(snr),
    }


def _experts_snr_hook(name: str, q_experts: FakeQuantExperts, quantized: set[str], signal: dict[str, float],
                      noise: dict[str, float]):
    """Forward hook on the reference's fused experts `name`: per routed expert and quantized matrix, add
    sum y^2 and sum (y - y_q)^2 (y on the reference's input, y_q = fq(input) W_q^T as `q_experts` computes)."""
    decoded = expert_matrices(name, q_experts)  # "<name>.<e>.<proj>" -> the checkpoint's decoded matrix
    arg_names = ("hidden_states", "top_k_index", "top_k_weights")  # transformers' experts signature

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, _output: torch.Tensor) -> None:
        hidden, top_k_index = (*args, *(kwargs[k] for k in arg_names[len(args):]))[:2]
        for p in routed_expert_passes(module, hidden, top_k_index):
            for proj, (x, y) in projection_outputs(p).items():
                matrix = f"{name}.{p.expert}.{proj}"
                if matrix not in quantized:
                    continue
                x_q = q_experts.fake_quant_input(x, p.expert, 1 if proj == "down_proj" else 0)  # input 0: gate/up, 1: down
                y_q = torch.nn.functional.linear(x_q, decoded[matrix])
                signal[matrix] = signal.get(matrix, 0.0) + energy(y)
                noise[matrix] = noise.get(matrix, 0.0) + energy(y_q - y)

    return hook


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
    if any(r["expert_snr_db"] for r in rows):  # MoE: one row per recipe and experts module
        lines += ["", "| recipe | experts | gate_proj SNR min / median (dB) | up_proj | down_proj | worst expert matrix |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            for experts, by_proj in r["expert_snr_db"].items():
                cells = [f"{v['min']:.1f} / {v['median']:.1f}" if (v := by_proj.get(p)) else "-"
                         for p in EXPERT_PROJECTIONS]
                proj, v = min(by_proj.items(), key=lambda kv: kv[1]["min"])
                lines.append(f"| {r['recipe']} | {experts} | {' | '.join(cells)} | {experts}.{v['min_expert']}.{proj} |")
    return "\n".join(lines), rows
