"""Runs INSIDE the llmcompressor venv (see llmcompressor_backend): one oneshot() quantization job.

    python -m quantkit.quantize.llmcompressor_worker JOB.json
JOB: {"model": dir, "out": dir, "scheme": "FP8_BLOCK" | "NVFP4", "ignore": [...], "calibration": tokens.pt?,
      "gptq": {"block_size": int, "dampening_frac": float}?,
      "modifiers": [{"name": "AWQModifier" | "SpinQuantModifier", "arguments": {...}}, ...]?,
      "pipeline": "basic" | "sequential"}
"basic": plain forward passes over the whole model (the sequential pipeline's fx tracing cannot wrap the zoo's
forward); "sequential": llm-compressor's layer-by-layer pipeline, which its AWQ needs (in "basic" every parent
output is NaN on CPU and AWQ skips every mapping).

On a machine without an accelerator, llm-compressor 0.14's AWQ pins its cached activations for host-to-device
copies (`IntermediatesCache.pin_memory`), which raises "Cannot access accelerator device when none is available";
pinning only speeds those copies, so the worker skips it there.
"""

import json
import sys
from pathlib import Path

import torch
from llmcompressor import oneshot
from llmcompressor.modifiers import transform
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from llmcompressor.pipelines.cache import IntermediatesCache
from transformers import AutoConfig, AutoTokenizer

from quantkit.models.attention import load_reference_model  # registers model_type "quantkit"


def main(job_path: str) -> None:
    """Run JOB.json: llmcompressor's oneshot() with the job's transform modifiers, then its scheme (by GPTQ when the
    job has "gptq"), on the float32 model (calibrated on its token windows (N, T) when given), saved compressed with
    the tokenizer to the job's out directory, its unquantized tensors in the source's dtype (`in_source_dtype`)."""
    job = json.loads(Path(job_path).read_text())
    source_dtype = AutoConfig.from_pretrained(job["model"]).dtype
    model = load_reference_model(job["model"], torch.float32)
    if not torch.accelerator.is_available():  # no device to copy to: nothing to pin (module docstring)
        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    # the transform modifiers (AWQ's scales, SpinQuant's rotations) in order, then the quantization
    recipe = [getattr(transform, m["name"])(**m["arguments"]) for m in job.get("modifiers", [])]
    if "gptq" in job:  # GPTQ rounding with the preset's scheme (its Hessians from the calibration windows)
        recipe.append(GPTQModifier(targets="Linear", scheme=job["scheme"], ignore=job["ignore"], **job["gptq"]))
    else:
        recipe.append(QuantizationModifier(targets="Linear", scheme=job["scheme"], ignore=job["ignore"]))
    if "calibration" in job:
        from datasets import Dataset

        tokens = torch.load(job["calibration"])
        data = Dataset.from_dict({"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()})
        oneshot(
            model=model,
            recipe=recipe,
            dataset=data,
            num_calibration_samples=len(tokens),
            max_seq_length=tokens.shape[1],
            pipeline=job.get("pipeline", "basic"),
        )
    else:
        oneshot(model=model, recipe=recipe)
    in_source_dtype(model, source_dtype)
    model.save_pretrained(job["out"], save_compressed=True)
    AutoTokenizer.from_pretrained(job["model"]).save_pretrained(job["out"])


def in_source_dtype(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Cast what llm-compressor did not quantize (embeddings, norms, biases, ignored layers such as lm_head) from the
    float32 copy it ran on back to the source's `dtype`, and record that dtype in the config: the checkpoint a
    user's run on the source saves, not one twice its size. A quantized module (one with a `quantization_scheme`)
    keeps its float32 weight and scales, which compression turns into codes, and casts only its bias."""
    if dtype is None or dtype == torch.float32:
        return
    for module in model.modules():
        quantized = getattr(module, "quantization_scheme", None) is not None
        for name, param in module.named_parameters(recurse=False):
            if param.is_floating_point() and (not quantized or name == "bias"):
                param.data = param.data.to(dtype)
    model.config.dtype = dtype


if __name__ == "__main__":
    main(sys.argv[1])
