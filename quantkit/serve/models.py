"""The quantkit model family as vLLM models (same safetensors as quantkit.models)."""

from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM


class QuantkitForCausalLM(Qwen3ForCausalLM):
    """vLLM model for `architectures: ["QuantkitForCausalLM"]`: the Qwen3 base of the family."""
