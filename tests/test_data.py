"""The data module: pinned offline corpora, token streams, and BOS windows for calibration and measurement."""

import logging
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from quantkit import data


def test_corpus_is_pinned_real_english():
    files = data.corpus_speeches()
    assert len(files) == 249 and files[0].name == "1790-Washington-1.txt"
    train, held_out = data.corpus_split()
    assert len(held_out) == data.VALIDATION_SPEECHES and len(train) == 249 - data.VALIDATION_SPEECHES
    assert " the " in train[0] and sum(len(t) for t in train) > 10_000_000
    assert data.heldout_texts() == held_out


def test_corpus_is_english_prose():
    texts = data.stdlib_docstrings()
    assert len(texts) > 500
    words = " ".join(texts).split()
    assert sum(w.lower() in {"the", "of", "and", "a", "to"} for w in words) / len(words) > 0.05


def test_token_stream_concatenates_texts_each_with_its_bos(tiny_checkpoint):
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    texts = ["Return the sum.", "A new list of items."]
    stream = data.token_stream(texts, tok)
    assert stream.dtype == torch.long and stream.dim() == 1
    assert stream.tolist() == tok(texts[0])["input_ids"] + tok(texts[1])["input_ids"]
    assert stream[0] == tok.bos_token_id


def test_windows_are_slices_with_bos_at_position_0():
    stream = torch.arange(100, 200)
    batch = data.windows(stream, [0, 7, 90], 10, bos_id=-1)
    assert batch.shape == (3, 10) and batch.dtype == torch.long
    assert batch[:, 0].tolist() == [-1, -1, -1]
    assert batch[1, 1:].tolist() == list(range(108, 117)) and batch[2, -1] == 199
    assert stream[0] == 100, "the stream itself is not modified"
    assert data.windows(stream, torch.tensor([3]), 4, bos_id=None).tolist() == [[103, 104, 105, 106]]


def test_spread_windows_cover_the_stream_evenly(caplog):
    stream = torch.arange(1000)
    batch = data.spread_windows(stream, 10, 100, None, "test")
    assert batch[:, 0].tolist() == list(range(0, 1000, 100)), "disjoint when the stream holds N x T tokens"
    batch = data.spread_windows(stream, 3, 10, 0, "test")
    assert batch[:, 1].tolist() == [1, 496, 991] and (batch[:, 0] == 0).all()
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING, logger="quantkit.data"):
        data.spread_windows(stream, 20, 100, None, "test")
    assert "test: 20 x 100 = 2000 tokens asked from a 1000-token corpus: windows overlap" in caplog.text
    with pytest.raises(ValueError, match="need num_sequences >= 1 and seq_len >= 2"):
        data.spread_windows(stream, 0, 10, None, "test")
    with pytest.raises(ValueError, match="test text has 1000 tokens, fewer than one window of seq_len=1001"):
        data.spread_windows(stream, 1, 1001, None, "test")


def test_calibration_and_heldout_windows(tiny_checkpoint):
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    heldout = data.heldout_windows(tok, 4, 64)
    stream = data.token_stream(data.heldout_texts(), tok)
    assert torch.equal(heldout, data.spread_windows(stream, 4, 64, tok.bos_token_id, "held-out"))
    assert torch.equal(data.calibration_windows(tok, 4, 64), heldout), "default calibration text: the held-out speeches"
    texts = data.stdlib_docstrings()[:50]
    own = data.calibration_windows(tok, 4, 64, texts)
    assert torch.equal(own, data.spread_windows(data.token_stream(texts, tok), 4, 64, tok.bos_token_id, "calibration"))
    with pytest.raises(ValueError, match="calibration texts must be a non-empty sequence of strings"):
        data.calibration_windows(tok, 4, 64, [])


def test_data_is_upstream_of_models_and_calibration():
    """quantkit.data imports no other quantkit module; calibration gets its data without the zoo."""
    code = ("import sys, quantkit.data; assert set(m for m in sys.modules if m.startswith('quantkit')) == {'quantkit', 'quantkit.data'}; "
            "import quantkit.calibrate; quantkit.data.heldout_texts(); assert 'quantkit.models.zoo' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
