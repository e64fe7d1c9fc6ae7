"""The quantkit model family in transformers: the reference forward pass for calibration and parity."""

from transformers import Qwen3ForCausalLM

from quantkit.models.configuration import QuantkitConfig


class QuantkitForCausalLM(Qwen3ForCausalLM):
    """Qwen3 decoder under `QuantkitConfig` (same parameter names as Qwen3: checkpoints load in vLLM)."""

    config_class = QuantkitConfig
