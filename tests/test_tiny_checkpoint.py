"""Tiny local checkpoints: tokenizer and weights round-trip through transformers' Auto classes."""

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantkit.models  # noqa: F401  (registers model_type "quantkit")


def test_tokenizer_round_trips(tiny_checkpoint):
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    text = "Return a new list containing all items from the iterable — in ascending order. ünïcödé 123"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id == 0, "position 0 is always BOS"
    assert tok.decode(ids, skip_special_tokens=True) == text
    english = "Return a new list containing all items from the iterable in ascending order."
    assert len(tok(english)["input_ids"]) < len(english) / 2, "BPE merges should compress English text"
    assert tok.eos_token == tok.bos_token == tok.pad_token == "<|endoftext|>"


def test_checkpoint_loads_exactly(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    assert type(model).__name__ == "QuantkitForCausalLM" and model.config.model_type == "quantkit"
    saved = load_file(tiny_checkpoint / "model.safetensors")
    state = model.state_dict()
    assert set(saved) == set(state)
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    weight = state["model.layers.0.self_attn.q_proj.weight"]
    # drawn N(0, 0.05): the sample std of n >= 4096 entries has relative sd 1/sqrt(2n) <= 1.1%; +-20% is > 18 sd
    assert 0.04 < weight.std().item() < 0.06
