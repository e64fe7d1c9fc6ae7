"""Checkpoint names vLLM's own model classes do not read yet, taught to their weight mappers.

quantkit writes a quantized checkpoint under the module names of the transformers model it quantized (one name
space for the writer, the fake-quant reference, quality and the checker). transformers 5 names some blocks
differently from the hub checkpoints vLLM's classes were written for: Mixtral's sparse MoE block is `mlp`
(experts `mlp.experts.<e>.gate_proj/up_proj/down_proj`, router `mlp.gate`) where the hub and vLLM say
`block_sparse_moe` (experts `w1/w3/w2`). `install()` adds the renames to the class's `hf_to_vllm_mapper` (vLLM
already maps gate_proj/up_proj/down_proj to w1/w3/w2 there); hub checkpoints hold no such names, so nothing else
changes. vLLM hands the same mapper to the quant config (`QuantkitQuantConfig.apply_vllm_mapper`), so the
quantized module names follow.
"""

from __future__ import annotations

RENAMES = {
    "vllm.model_executor.models.mixtral:MixtralModel": {
        ".mlp.experts.": ".block_sparse_moe.experts.",
        ".mlp.gate.": ".block_sparse_moe.gate.",
    },
}


def install() -> None:
    """Put RENAMES first in each class's mapper (in place: the causal-LM class shares its model's mapper object;
    idempotent)."""
    import importlib

    for target, renames in RENAMES.items():
        module, _, name = target.partition(":")
        mapper = getattr(importlib.import_module(module), name).hf_to_vllm_mapper
        mapper.orig_to_new_substr = {**renames, **mapper.orig_to_new_substr}
