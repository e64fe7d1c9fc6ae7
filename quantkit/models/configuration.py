"""Configuration of the quantkit model family.

The base is a Qwen3-style dense decoder (pre-norm RMSNorm, RoPE, GQA, per-head q/k RMSNorm, SwiGLU),
stored with `model_type: "quantkit"` and `architectures: ["QuantkitForCausalLM"]` so that both
transformers and vLLM route it to our code. Architecture-variant flags (papers in shared/papers) are
fields of this config.
"""

from transformers import Qwen3Config


class QuantkitConfig(Qwen3Config):
    """Qwen3Config under the `quantkit` model type; all Qwen3 fields keep their meaning."""

    model_type = "quantkit"
