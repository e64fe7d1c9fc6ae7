"""A tiny Qwen2 GGUF written with the `gguf` package (llama.cpp's writer), for tests of `quantkit import-gguf`.

Two layers, hidden 64, float32 tensors, the tiny checkpoint's byte-level BPE vocabulary (tokenizer.ggml.model
gpt2, pre qwen2); `add_bos` / `add_eos` set the GGUF's tokenizer.ggml.add_bos_token / add_eos_token (None: absent).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128


def write_tiny_qwen2_gguf(
    path: Path, tokenizer_json: Path, *, add_bos: bool | None, add_eos: bool | None = None
) -> Path:
    import gguf

    tok = json.loads(Path(tokenizer_json).read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if add_eos is not None:
        writer.add_add_eos_token(add_eos)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        data = rng.standard_normal(shape).astype(np.float32) * (0.02 if len(shape) > 1 else 1.0)
        writer.add_tensor(name, data if len(shape) > 1 else np.abs(data))

    head_dim = HIDDEN // HEADS
    tensor("token_embd.weight", len(tokens), HIDDEN)
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.attn_q.bias", HIDDEN)
        tensor(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_k.bias", KV_HEADS * head_dim)
        tensor(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_v.bias", KV_HEADS * head_dim)
        tensor(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.ffn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    tensor("output_norm.weight", HIDDEN)
    tensor("output.weight", len(tokens), HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
