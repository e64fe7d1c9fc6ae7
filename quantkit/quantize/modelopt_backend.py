"""Export through nvidia-modelopt for the schemes it has (recipes with `backend: modelopt`).

    NVFP4                       mtq.NVFP4_DEFAULT_CFG: W4A4, weights with a per-tensor global scale,
                                activations with a STATIC calibrated global scale (`input_scale`)
    FP8_PER_CHANNEL_PER_TOKEN   mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG: FP8 E4M3 weights with one scale per
                                output channel, dynamic per-token activations

ModelOpt has no 128x128-block FP8 W8A8 scheme and no per-token NVFP4 activation scale, so these are
comparison rows, not the paper's schemes. Calibration ("max") runs on CPU over held-out corpus
sequences; the output is ModelOpt's unified Hugging Face checkpoint (`quant_method: "modelopt"`,
plus `hf_quant_config.json`), which vLLM serves (on CPU too: docs/serving.md). Written atomically like ours;
ModelOpt's own failures (and a missing nvidia-modelopt) raise BackendError naming the recipe.

A recipe's `peer_modifiers` may name one of ModelOpt's calibration algorithms instead of "max" (`awq_lite`, as
NVFP4_AWQ_LITE_CFG; `awq_clip`, `awq_full`, `mse`; recipe.PEER_MODIFIERS). Their searches fake-quantize NVFP4
with Triton kernels ModelOpt 0.42 loads on CUDA only; without a GPU they run on `quantkit.quantize.modelopt_cpu`'s
torch transcriptions of those kernels (ModelOpt's algorithms unchanged).
"""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from quantkit.atomic import atomic_dir
from quantkit.checkpoints import write_source_record
from quantkit.errors import BackendError
from quantkit.models.attention import load_reference_model
from quantkit.quantize.modelopt_cpu import modelopt_fp4_on_cpu
from quantkit.quantize.plan import calibration_windows_of
from quantkit.quantize.recipe import Recipe

CONFIGS = {"NVFP4": "NVFP4_DEFAULT_CFG", "FP8_PER_CHANNEL_PER_TOKEN": "FP8_PER_CHANNEL_PER_TOKEN_CFG"}


@contextmanager
def _cpu_safe_fp4_check():
    """ModelOpt 0.42 asks `torch.cuda.get_device_capability` before its pure-torch NVFP4 path and crashes
    on CPU-only torch; answer "no FP4 hardware" there (which selects that pure-torch path)."""
    import modelopt.torch.quantization.qtensor.nvfp4_tensor as nvfp4_tensor

    original = nvfp4_tensor.fp4_compatible
    nvfp4_tensor.fp4_compatible = lambda: torch.cuda.is_available() and original()
    try:
        yield
    finally:
        nvfp4_tensor.fp4_compatible = original


def modelopt_config(recipe: Recipe, model: torch.nn.Module) -> dict:
    """ModelOpt's preset for the recipe's scheme, with the recipe's ignore list disabled by exact module name and the
    calibration algorithm its `peer_modifiers` names (ModelOpt's own: awq_lite, awq_clip, awq_full, mse; with its
    arguments), else the preset's ("max")."""
    import modelopt.torch.quantization as mtq

    config = copy.deepcopy(getattr(mtq, CONFIGS[recipe.scheme]))
    for name, args in recipe.peer_modifiers:  # at most one: the recipe refuses more (PEER_MODIFIERS)
        config["algorithm"] = {"method": name, **dict(args)}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and recipe.ignores(name):
            config["quant_cfg"][f"{name}.*"] = {"enable": False}
    return config


def quantize_with_modelopt(model_dir: Path, recipe: Recipe, out_dir: Path) -> Path:
    """Calibrate and export `model_dir` with ModelOpt's preset for `recipe.scheme` into `out_dir`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # modelopt warns about the transformers version on import
            import modelopt.torch.quantization as mtq
            from modelopt.torch.export import export_hf_checkpoint
    except ImportError as err:
        raise BackendError(f"recipe {recipe.name} needs nvidia-modelopt ({err}): pip install -e '.[backends]'") from err

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_reference_model(model_dir, torch.bfloat16)
    # ModelOpt calibrates every preset: one set of windows (`quantkit.quantize.plan.SCALE_CALIBRATION`)
    (windows,) = calibration_windows_of(recipe, model.config.max_position_embeddings, model.config.model_type)
    tokens = windows.tokens(tokenizer)

    def forward_loop(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for row in tqdm(tokens, desc=f"modelopt calibration {recipe.name}", unit="seq"):
                m(row[None])

    with atomic_dir(out_dir, overwrite=True) as tmp:
        try:
            with _cpu_safe_fp4_check(), modelopt_fp4_on_cpu():
                mtq.quantize(model, modelopt_config(recipe, model), forward_loop)
                export_hf_checkpoint(model, export_dir=str(tmp))
        except Exception as err:  # ModelOpt raises its own and torch's error types
            raise BackendError(
                f"modelopt failed on {model_dir} with recipe {recipe.name}: {type(err).__name__}: {err}"
            ) from err
        tokenizer.save_pretrained(tmp)
        write_source_record(tmp, model_dir)
    return out_dir
