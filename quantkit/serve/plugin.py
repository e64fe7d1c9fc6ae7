"""quantkit's vLLM plugin (entry point group `vllm.general_plugins`, see pyproject.toml).

vLLM calls `register()` in every process it starts (the API process, the engine core, each worker),
so everything the engine must know about quantkit is registered here, never in the launching script.
Set VLLM_PLUGINS="" to run vLLM without it.
"""

from __future__ import annotations

import os

# architecture name in config.json -> "module:class" (imported lazily by vLLM's registry)
ARCHITECTURES = {
    "QuantkitForCausalLM": "quantkit.serve.models:QuantkitForCausalLM",
    "QuantkitHybridForCausalLM": "quantkit.serve.hybrid:QuantkitHybridForCausalLM",
}

# When set, each process that runs register() appends its pid to this file (tests use it to prove
# the plugin ran inside vLLM's engine process).
TRACE_ENV = "QUANTKIT_PLUGIN_TRACE"


def register() -> None:
    """Register quantkit's config type with transformers, its architectures, its quantization method
    (`quant_method: "quantkit"`), CPU emulation kernels for the peers' formats, ModelOpt's NVFP4_AWQ exports
    (`quantkit.serve.modelopt_awq`), float32 loading of SmoothQuant's folded norm weights
    (`quantkit.serve.float32_norms`), the module names of transformers 5 for vLLM's stock classes
    (`quantkit.serve.stock_names`), prompt log-probabilities from a requested position on
    (`quantkit.serve.prompt_logprobs`), and, on CPUs without bf16 matmuls,
    the batched Gated DeltaNet prefill conv (`quantkit.serve.cpu.gdn`) and float32 compute for unquantized bf16
    Linears (`quantkit.serve.cpu.linear`) with vLLM; on machines without CUDA, large tensors from malloc's heap
    (`quantkit.serve.cpu.heap`) (idempotent)."""
    from vllm import ModelRegistry

    import quantkit.models
    import quantkit.serve.quant_method  # noqa: F401  (@register_quantization_config("quantkit"))
    from quantkit.serve import float32_norms, modelopt_awq, prompt_logprobs, stock_names
    from quantkit.serve.cpu import gdn as gdn_cpu
    from quantkit.serve.cpu import heap as cpu_heap
    from quantkit.serve.cpu import linear as cpu_linear
    from quantkit.serve.cpu.peer_kernels import register_cpu_emulation_kernels

    register_cpu_emulation_kernels()
    modelopt_awq.install()
    float32_norms.install()
    stock_names.install()
    prompt_logprobs.install()
    gdn_cpu.install()
    cpu_linear.install()
    cpu_heap.install()

    for arch, target in ARCHITECTURES.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, target)

    trace = os.environ.get(TRACE_ENV)
    if trace:
        with open(trace, "a") as f:
            f.write(f"{os.getpid()}\n")
