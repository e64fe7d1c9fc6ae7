"""Byte-level BPE tokenizers trained locally (there is no model hub here).

Conventions: one special token, `<|endoftext|>` (id 0), which serves as BOS, EOS and padding; encoding
with special tokens (the default of transformers, vLLM and lm-eval) prepends it, so position 0 of every
sequence is BOS (the attention-sink variant stores its k', v' there); byte-level pre-tokenization, so
every string round-trips through encode/decode (skip_special_tokens=True drops the BOS).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
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
    bos_id = tok.token_to_id(END_OF_TEXT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{END_OF_TEXT} $A", pair=f"{END_OF_TEXT} $A {END_OF_TEXT} $B", special_tokens=[(END_OF_TEXT, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> None:
    """Write tokenizer.json + tokenizer_config.json (loadable by transformers, vLLM and lm-eval)."""
    tokenizer.save_pretrained(str(out_dir))
