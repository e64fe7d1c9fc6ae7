"""Byte-level BPE tokenizers trained locally (there is no model hub here).

Conventions: one special token, `<|endoftext|>` (id 0), which serves as BOS, EOS and padding; byte-level
pre-tokenization, so every string round-trips through encode/decode.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with `vocab_size` entries (special token included) on `texts`."""
    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size} is below the 256 byte symbols plus {END_OF_TEXT}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """Write tokenizer.json + tokenizer_config.json (loadable by transformers, vLLM and lm-eval)."""
    tokenizer.save_pretrained(str(out_dir))
