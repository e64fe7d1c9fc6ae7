"""Runs INSIDE the llmcompressor venv (see llmcompressor_backend): one oneshot() quantization job.

    python -m quantkit.quantize.llmcompressor_worker JOB.json
JOB: {"model": dir, "out": dir, "scheme": "FP8_BLOCK" | "NVFP4", "ignore": [...], "calibration": tokens.pt?,
      "gptq": {"block_size": int, "dampening_frac": float}?}
"""

import json
import sys
from pathlib import Path

import torch
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from transformers import AutoTokenizer

from quantkit.models.attention import load_reference_model  # registers model_type "quantkit"


def main(job_path: str) -> None:
    """Run JOB.json: llmcompressor's oneshot() with the job's scheme (by GPTQ when the job has "gptq") on the float32
    model (calibrated on its token windows (N, T) when given), saved compressed with the tokenizer to the job's out
    directory."""
    job = json.loads(Path(job_path).read_text())
    model = load_reference_model(job["model"], torch.float32)
    if "gptq" in job:  # GPTQ rounding with the preset's scheme (its Hessians from the calibration windows)
        recipe = GPTQModifier(targets="Linear", scheme=job["scheme"], ignore=job["ignore"], **job["gptq"])
    else:
        recipe = QuantizationModifier(targets="Linear", scheme=job["scheme"], ignore=job["ignore"])
    if "calibration" in job:
        from datasets import Dataset

        tokens = torch.load(job["calibration"])
        data = Dataset.from_dict({"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()})
        # "basic" pipeline: plain forward passes (the sequential pipeline's fx tracing cannot wrap our forward)
        oneshot(
            model=model,
            recipe=recipe,
            dataset=data,
            num_calibration_samples=len(tokens),
            max_seq_length=tokens.shape[1],
            pipeline="basic",
        )
    else:
        oneshot(model=model, recipe=recipe)
    model.save_pretrained(job["out"], save_compressed=True)
    AutoTokenizer.from_pretrained(job["model"]).save_pretrained(job["out"])


if __name__ == "__main__":
    main(sys.argv[1])
