"""The data module: pinned offline corpora, token streams, and BOS windows for calibration and measurement."""

import json
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


def test_token_streams_are_remembered_per_tokenizer_and_texts(tiny_checkpoint, tmp_path):
    """A second call with the same tokenizer and texts returns the remembered stream, equal to encoding text by
    text, as a new tensor (writing into it changes nothing remembered); other texts, or a tokenizer that encodes
    differently (no BOS), get their own stream."""
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    texts = ["Return the sum.", "A new list of items.", ""]
    expected = [i for t in texts for i in tok(t)["input_ids"]]
    first = data.token_stream(texts, tok)
    first[:] = -1
    second = data.token_stream(texts, tok)
    assert second.tolist() == expected
    assert data.token_stream(texts[:1], tok).tolist() == tok(texts[0])["input_ids"]
    tok.save_pretrained(tmp_path)
    no_bos = AutoTokenizer.from_pretrained(tmp_path, add_bos_token=False)
    assert no_bos(texts[0])["input_ids"] == tok(texts[0])["input_ids"][1:]  # the edit took: no BOS now
    assert data.token_stream(texts, no_bos).tolist() == [i for t in texts for i in no_bos(t)["input_ids"]]


def test_token_streams_are_kept_on_disk_for_the_next_process(tiny_checkpoint, tmp_path, monkeypatch, caplog):
    """A stream encoded once is read back from the cache directory by a process that has not encoded it (the memo
    cleared stands for a new process): equal, int64, and without encoding again (the tokenizer is replaced by one
    that fails when called); a damaged file is encoded again with a warning and rewritten; "off" keeps nothing."""
    monkeypatch.setenv(data.STREAM_CACHE_ENV, str(tmp_path / "streams"))
    monkeypatch.setattr(data, "_streams", data.OrderedDict())
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    texts = ["Return the sum.", "A new list of items."]
    first = data.token_stream(texts, tok)
    (stored,) = (tmp_path / "streams").glob("*.npy")
    data._streams.clear()

    class Encoded:  # the tokenizer's pipeline (the cache key) without its encoder
        backend_tokenizer = tok.backend_tokenizer

        def __call__(self, *args, **kwargs):
            raise AssertionError("encoded again")

    again = data.token_stream(texts, Encoded())
    assert again.dtype == torch.long and torch.equal(again, first)
    data._streams.clear()
    stored.write_bytes(b"not a numpy file")
    with caplog.at_level(logging.WARNING):
        assert torch.equal(data.token_stream(texts, tok), first)
    assert "unreadable" in caplog.text
    data._streams.clear()
    assert torch.equal(data.token_stream(texts, Encoded()), first)  # rewritten
    monkeypatch.setenv(data.STREAM_CACHE_ENV, "off")
    data._streams.clear()
    assert data.token_stream_cache_dir() is None
    with pytest.raises(AssertionError, match="encoded again"):
        data.token_stream(texts, Encoded())


def test_windows_are_slices_with_bos_at_position_0():
    stream = torch.arange(100, 200)
    batch = data.windows(stream, [0, 7, 90], 10, -1)
    assert batch.shape == (3, 10) and batch.dtype == torch.long
    assert batch[:, 0].tolist() == [-1, -1, -1]
    assert batch[1, 1:].tolist() == list(range(108, 117)) and batch[2, -1] == 199
    assert stream[0] == 100, "the stream itself is not modified"
    assert data.windows(stream, torch.tensor([3]), 4, None).tolist() == [[103, 104, 105, 106]]
    assert data.windows(stream, [0], 4, [7, 8]).tolist() == [[7, 8, 102, 103]]  # a two-token prompt prefix


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
    """Measurement reads the held-out speeches; calibration never does (the zoo's default: the training
    speeches); every window starts as the tokenizer starts a served prompt."""
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    assert data.served_prefix(tok) == [tok.bos_token_id]  # quantkit's tokenizers prepend BOS
    heldout = data.heldout_windows(tok, 4, 64)
    stream = data.token_stream(data.heldout_texts(), tok)
    assert torch.equal(heldout, data.spread_windows(stream, 4, 64, [tok.bos_token_id], "held-out"))
    assert data.default_calibration_source("quantkit") == "speeches"
    calibration = data.calibration_windows(tok, 4, 64, "speeches")
    train = data.token_stream(data.corpus_split()[0], tok)
    assert torch.equal(calibration, data.spread_windows(train, 4, 64, [tok.bos_token_id], "calibration"))
    held = {tuple(row[1:].tolist()) for row in data.spread_windows(stream, 512, 64, None, "held-out")}
    assert not held & {tuple(row[1:].tolist()) for row in calibration}
    texts = data.stdlib_docstrings()[:50]
    own = data.calibration_windows(tok, 4, 64, texts)
    assert torch.equal(
        own, data.spread_windows(data.token_stream(texts, tok), 4, 64, [tok.bos_token_id], "calibration")
    )
    with pytest.raises(ValueError, match="calibration texts must be a non-empty sequence of strings"):
        data.calibration_windows(tok, 4, 64, [])


def test_calibration_sources_mix_files_and_chat_samples(tmp_path):
    """Parts joined by '+' share the windows evenly and alternate; .txt and .jsonl files ("text" or chat
    "messages" through the template) are sources too; bad sources are named errors."""
    from quantkit.models.tokenizer import train_bpe_tokenizer

    tok = train_bpe_tokenizer(data.stdlib_docstrings()[:200], 300)
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    assert data.default_calibration_source("llama") == "speeches+code"
    mixed = data.calibration_windows(tok, 5, 32, "speeches+code")
    speeches = data.calibration_windows(tok, 3, 32, "speeches")
    code = data.calibration_windows(tok, 2, 32, "code")
    assert torch.equal(mixed, torch.stack([speeches[0], code[0], speeches[1], code[1], speeches[2]]))
    (tmp_path / "notes.txt").write_text("Release notes. " * 400)
    lines = [
        {"text": "def add(a, b):\n    return a + b\n" * 20},
        {"messages": [{"role": "user", "content": "Sum 2 and 3."}, {"role": "assistant", "content": "5"}]},
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) * 30)
    both = data.calibration_windows(tok, 4, 16, f"{tmp_path / 'notes.txt'}+{tmp_path / 'chat.jsonl'}")
    assert both.shape == (4, 16)
    texts = data.calibration_parts(str(tmp_path / "chat.jsonl"), tok)[0][1]
    assert "<|user|>Sum 2 and 3." in texts[1]
    with pytest.raises(ValueError, match="unknown calibration source part 'novels'"):
        data.calibration_windows(tok, 4, 16, "speeches+novels")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"prompt": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: expected an object"):
        data.calibration_windows(tok, 4, 16, str(tmp_path / "bad.jsonl"))
    tok.chat_template = None
    with pytest.raises(ValueError, match="line 2: chat messages, but the tokenizer has no chat template"):
        data.calibration_parts(str(tmp_path / "chat.jsonl"), tok)
    with pytest.raises(FileNotFoundError, match=r"missing.txt not found"):
        data.calibration_windows(tok, 4, 16, str(tmp_path / "missing.txt"))


def test_data_is_upstream_of_models_and_calibration():
    """quantkit.data imports no other quantkit module but the leaves it writes with (atomic writes and their errors);
    calibration gets its data without the zoo."""
    code = (
        "import sys, quantkit.data; assert set(m for m in sys.modules if m.startswith('quantkit')) == "
        "{'quantkit', 'quantkit.data', 'quantkit.atomic', 'quantkit.errors'}; "
        "import quantkit.calibrate; quantkit.data.heldout_texts(); assert 'quantkit.models.zoo' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
