"""The quantkit model family (Hugging Face side) and the tiny local checkpoints the tests build.

Importing this package registers `model_type: "quantkit"` with transformers' AutoConfig and
AutoModelForCausalLM, so `AutoModelForCausalLM.from_pretrained(dir)` loads our checkpoints.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from quantkit.models.configuration import QuantkitConfig
from quantkit.models.modeling import QuantkitForCausalLM

AutoConfig.register(QuantkitConfig.model_type, QuantkitConfig, exist_ok=True)
AutoModelForCausalLM.register(QuantkitConfig, QuantkitForCausalLM, exist_ok=True)

__all__ = ["QuantkitConfig", "QuantkitForCausalLM"]
