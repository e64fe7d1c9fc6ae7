"""Tiny random checkpoints of the quantkit family, built locally for tests and smoke runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from quantkit.models import QuantkitConfig, QuantkitForCausalLM
from quantkit.models.corpus import stdlib_docstrings
from quantkit.models.tokenizer import save_tokenizer, train_bpe_tokenizer

TINY_SHAPE: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def build_tiny_checkpoint(
    out_dir: str | Path,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    init_std: float = 0.05,
    **config_overrides: Any,
) -> Path:
    """Train a tokenizer on stdlib docstrings and save a randomly initialized model with it.

    Weights are drawn N(0, init_std) (norm weights stay 1) with a fixed `seed`, large enough that the
    next-token distributions are far from uniform, so logprob comparisons are meaningful.
    """
    out_dir = Path(out_dir)
    tokenizer = train_bpe_tokenizer(stdlib_docstrings(), vocab_size)
    config = QuantkitConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{**TINY_SHAPE, **config_overrides},
    )
    torch.manual_seed(seed)
    model = QuantkitForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, init_std)
    model.to(dtype).save_pretrained(out_dir)
    save_tokenizer(tokenizer, out_dir)
    return out_dir
