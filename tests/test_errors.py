"""docs/errors.md, one test per row: bad input at every `quantkit` command ends as a named error, exit 2.

Each case runs `quantkit.cli.main` in this process on inputs built here (from the tiny checkpoint), and
asserts the exit code, `quantkit <command>: error: <message>` on stderr and no traceback. The checks fire
before any engine starts or model trains, so every case is cheap. One case runs the installed `quantkit`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_gguf import write_tiny_qwen2_gguf

from quantkit.atomic import exclusive_lock
from quantkit.cli import main
from quantkit.errors import QuantkitError
from quantkit.models.tiny import build_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
PAPER = REPO / "tests" / "fixtures" / "paper000_table2.json"
DEFAULT_SPEC = REPO / "pipelines" / "default.yaml"
# The commands that take a checkpoint directory; each checks it before any work.
CHECKPOINT_COMMANDS = {
    "quantize": lambda model, tmp: ["quantize", model, "w4a4_nvfp4", tmp / "out"],
    "quality": lambda model, tmp: ["quality", model, tmp / "quantized"],
    "diagnose": lambda model, tmp: ["diagnose", model, "--out", tmp / "diagnostics"],
    "serve": lambda model, tmp: ["serve", model],
    "generate": lambda model, tmp: ["generate", model, "hello"],
    "eval": lambda model, tmp: ["eval", model, "--out", tmp / "eval"],
    "run": lambda model, tmp: ["run", DEFAULT_SPEC, "--model", model, "--run-dir", tmp / "run"],
}


def _copy(source: Path, dest: Path, edit: Callable[[Path], object]) -> Path:
    shutil.copytree(source, dest)
    edit(dest)
    return dest


def _with_nan_norm(model_dir: Path) -> None:
    state = load_file(model_dir / "model.safetensors")
    state["model.layers.1.input_layernorm.weight"][3] = float("nan")
    save_file(state, model_dir / "model.safetensors", metadata={"format": "pt"})


def _gpt2(model_dir: Path, tokenizer_dir: Path) -> Path:
    """A tiny GPT-2: an architecture without Llama-style decoder layers (SmoothQuant cannot map it)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=32, n_layer=1, n_head=2)).save_pretrained(
        model_dir
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, model_dir / name)
    return model_dir


@pytest.fixture(scope="module")
def inputs(tiny_checkpoint, tmp_path_factory) -> SimpleNamespace:
    """Every bad input of the table, built once from the tiny checkpoint."""
    root = tmp_path_factory.mktemp("bad_inputs")
    copy = functools.partial(_copy, tiny_checkpoint)
    weights = (tiny_checkpoint / "model.safetensors").read_bytes()
    paper = json.loads(PAPER.read_text())
    (root / "sq_quick.yaml").write_text(
        "name: sq_quick\nscheme: nvfp4\nsmoothquant: {alpha: 0.5, num_sequences: 4, seq_len: 32}\n"
    )
    (root / "bad_recipe.yaml").write_text("name: bad_recipe\nscheme: nvfp4\nsmoothing: true\n")
    (root / "spec.yaml").write_text(DEFAULT_SPEC.read_text() + "nope: 1\n")
    (root / "spec_calibration.yaml").write_text(
        DEFAULT_SPEC.read_text().replace("calibration: {num_sequences: 256", "calibration: {num_sequences: 0")
    )
    # data parallel 2 with KL from transformers (engine-side KL refuses dp > 1 first): the Ray executor's own check
    (root / "dp_spec.yaml").write_text(
        DEFAULT_SPEC.read_text()
        .replace("data_parallel_size: 1", "data_parallel_size: 2")
        .replace("seq_len: 128}", "seq_len: 128, source: transformers}", 1)
    )
    (root / "results.json").write_text(json.dumps({"schema_version": 1, "rows": []}))
    (root / "gate.yaml").write_text("max_drop: 1.0\nnope: 2\n")
    (root / "current.json").write_text(json.dumps(dict(paper, rows=[r for r in paper["rows"] if r["id"] != "(7)"])))
    (root / "python").write_text(
        "#!/bin/sh\necho 'loading the model' >&2\necho 'ValueError: scheme FP8_BLOCK: injected failure' >&2\nexit 3\n"
    )
    (root / "python").chmod(0o755)
    (root / "no_eval_data").mkdir()
    (root / "a_file").write_text("not a directory\n")
    (root / "syntax.yaml").write_text("name: syntax\nscheme: nvfp4\nsmoothquant: {alpha: 0.5\n")
    (root / "spec_syntax.yaml").write_text(DEFAULT_SPEC.read_text() + "eval: [unclosed\n")
    for name, settings in {
        "alpha_half": "smoothquant: {alpha: half}",
        "block_words": "gptq: {block_size: sixteen}",
        "dampening_words": "gptq: {dampening: lots}",
        "dampening_negative": "gptq: {dampening: -1}",
    }.items():
        (root / f"{name}.yaml").write_text(f"name: {name}\nscheme: nvfp4\n{settings}\n")
    (root / "spec_suite.yaml").write_text(
        DEFAULT_SPEC.read_text().replace("suite: smoke", "suite: smokey").replace("suite: mini", "suite: minni")
    )
    (root / "spec_hf.yaml").write_text(DEFAULT_SPEC.read_text().replace("backend: vllm", "backend: hf"))
    (root / "spec_code.yaml").write_text(DEFAULT_SPEC.read_text().replace("allow_code: false", "allow_code: true"))
    fp8 = root / "fp8"
    main(["quantize", str(tiny_checkpoint), "w8a8_fp8_block", str(fp8)])  # a real quantized checkpoint to break
    other = build_tiny_checkpoint(root / "other_model", seed=1)  # same architecture, other weights
    gguf = write_tiny_qwen2_gguf(root / "tiny.gguf", tiny_checkpoint / "tokenizer.json", add_bos=True)
    (root / "cut_header.gguf").write_bytes(gguf.read_bytes()[:4000])
    (root / "cut_half.gguf").write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    return SimpleNamespace(
        root=root,
        tiny=tiny_checkpoint,
        no_config=copy(root / "no_config", lambda d: (d / "config.json").unlink()),
        bad_json=copy(root / "bad_json", lambda d: (d / "config.json").write_text("{not json")),
        no_weights=copy(root / "no_weights", lambda d: (d / "model.safetensors").unlink()),
        truncated=copy(
            root / "truncated", lambda d: (d / "model.safetensors").write_bytes(weights[: len(weights) // 2])
        ),
        fake_quantized=copy(
            root / "fake_quantized",
            lambda d: (d / "config.json").write_text(
                json.dumps(
                    dict(
                        json.loads((d / "config.json").read_text()),
                        quantization_config={"quant_method": "quantkit", "format_version": 2},
                    )
                )
            ),
        ),
        nan_weights=copy(root / "nan_weights", _with_nan_norm),
        no_tokenizer=copy(
            root / "no_tokenizer", lambda d: [(d / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")]
        ),
        gpt2=_gpt2(root / "gpt2", tiny_checkpoint),
        fp8=fp8,
        other=other,
        more_layers=copy(root / "more_layers", functools.partial(_edit_config, num_hidden_layers=3, layer_types=None)),
        wider_mlp=copy(root / "wider_mlp", functools.partial(_edit_config, intermediate_size=520)),
        garbage_qc=copy(root / "garbage_qc", functools.partial(_edit_config, quantization_config="garbage")),
        fp8_no_qc=_copy(fp8, root / "fp8_no_qc", functools.partial(_edit_config, quantization_config=None)),
        fp8_says_nvfp4=_copy(fp8, root / "fp8_says_nvfp4", _claim_nvfp4),
        ct_fp8=_copy(fp8, root / "ct_fp8", functools.partial(_edit_config, quantization_config=CT_FP8)),
        ct_nvfp4_unpacked=_copy(fp8, root / "ct_nvfp4", functools.partial(_edit_config, quantization_config=CT_NVFP4)),
        ct_nvfp4_rotated=_copy(
            fp8, root / "ct_nvfp4_rotated", functools.partial(_edit_config, quantization_config=CT_NVFP4_SPINQUANT)
        ),
    )


CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized"}  # a peer's FP8 checkpoint's config
CT_NVFP4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
# llm-compressor's SpinQuantModifier writes its folded rotations as a transform_config (R1: the residual stream)
CT_NVFP4_SPINQUANT = CT_NVFP4 | {
    "transform_config": {
        "config_groups": {
            "R1": {
                "type": "hadamard",
                "head_dim": 16,
                "apply": [{"location": "weight_output", "targets": ["re:.*embed_tokens$"]}],
            }
        }
    }
}


def _edit_config(model_dir: Path, **changes) -> None:
    """config.json with `changes` applied (a None value removes the key)."""
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def _claim_nvfp4(model_dir: Path) -> None:
    """An FP8 checkpoint whose quantization_config says nvfp4."""
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"]["scheme"] = "nvfp4"
    (model_dir / "config.json").write_text(json.dumps(config))


def _run(capsys, argv: list) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _assert_named_error(code: int, err: str, command: str, match: str) -> None:
    """Exit 2, `quantkit <command>: error: <match>` on stderr (after any progress bars), no traceback."""
    prefix = f"quantkit {command}: error: "
    assert code == 2 and prefix in err, err
    assert re.search(match, err.split(prefix, 1)[1]), err
    assert "Traceback" not in err


# ------------------------------------------------------------------ rows 1-4: every checkpoint command

CHECKPOINT_ROWS = {
    "no_config": r"is not a checkpoint directory \(no config\.json\)",
    "bad_json": r"config\.json: not valid JSON",
    "no_weights": r"no \*\.safetensors weights",
    "truncated": r"model\.safetensors: unreadable safetensors file \(truncated or corrupt\?\)",
}


@pytest.mark.parametrize("defect", CHECKPOINT_ROWS)
@pytest.mark.parametrize("command", CHECKPOINT_COMMANDS)
def test_checkpoint_checked_first(inputs, capsys, tmp_path, command, defect):
    code, _, err = _run(capsys, CHECKPOINT_COMMANDS[command](getattr(inputs, defect), tmp_path))
    _assert_named_error(code, err, command, CHECKPOINT_ROWS[defect])
    assert not any(tmp_path.iterdir()), "nothing written"


def test_truncated_shard_through_the_installed_command(inputs, tmp_path):
    """The issue's example, through the real `quantkit` executable."""
    quantkit = Path(sys.executable).parent / "quantkit"
    run = subprocess.run(
        [quantkit, "quantize", inputs.truncated, "w4a4_nvfp4", tmp_path / "out"], capture_output=True, text=True
    )
    _assert_named_error(
        run.returncode, run.stderr, "quantize", r"unreadable safetensors file \(truncated or corrupt\?\)"
    )


# ------------------------------------------------------------------ the other rows


@dataclass(frozen=True)
class Row:
    command: str
    argv: Callable[[SimpleNamespace, Path], list]
    match: str
    setup: Callable[[SimpleNamespace, pytest.MonkeyPatch], object] | None = None  # may return a context to hold


def _quantize_tiny(recipe_file: str, match: str, setup: Callable | None = None) -> Row:
    """A `quantize` row: the tiny checkpoint under a recipe file of the fixture folder, into a fresh output."""
    return Row("quantize", lambda p, t: ["quantize", p.tiny, p.root / recipe_file, t / "out"], match, setup)


def _diagnose_tiny(recipe: str, match: str) -> Row:
    """A `diagnose` row: the tiny checkpoint diagnosed under a named recipe."""
    return Row("diagnose", lambda p, t: ["diagnose", p.tiny, "--recipes", recipe, "--out", t / "d"], match)


def _break_the_norm_fold(_, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SmoothQuant fold that forgets to divide the norm weight: what a wrong mapping does."""
    from quantkit.calibrate import mappings
    from quantkit.models.modeling import QuantkitNorm

    monkeypatch.setitem(mappings._FOLDS, QuantkitNorm, lambda norm, s: None)


def _fake_llmcompressor_python(paths, monkeypatch: pytest.MonkeyPatch) -> None:
    """The llmcompressor venv's python is the fixture's fake worker (it fails with an injected error)."""
    monkeypatch.setenv("QUANTKIT_LLMCOMPRESSOR_PYTHON", str(paths.root / "python"))


def _fail_modelopt_calibration(_, monkeypatch: pytest.MonkeyPatch) -> None:
    import modelopt.torch.quantization as mtq

    def fail(*args, **kwargs):
        raise RuntimeError("injected calibration failure")

    monkeypatch.setattr(mtq, "quantize", fail)


ROWS = {
    "servable_check": Row("serve", lambda p, t: ["serve", p.fake_quantized], r"format_version 2 is not supported"),
    "unknown_recipe": Row(
        "quantize", lambda p, t: ["quantize", p.tiny, "w3a3", t / "out"], r"unknown recipe 'w3a3'; available: \["
    ),
    "bad_recipe_file": _quantize_tiny("bad_recipe.yaml", r"unknown recipe key\(s\) \['smoothing'\]"),
    "output_exists": Row(
        "quantize", lambda p, t: ["quantize", p.tiny, "bf16", p.root], r"exists; pass overwrite=True \(--overwrite\)"
    ),
    "smoothquant_nan": Row(
        "quantize",
        lambda p, t: ["quantize", p.nan_weights, p.root / "sq_quick.yaml", t / "out"],
        r"SmoothQuant: non-finite activation statistics at the input of model\.layers\.1\.self_attn\.q_proj \(NaN",
    ),
    "smoothquant_mapping": Row(
        "quantize",
        lambda p, t: ["quantize", p.gpt2, p.root / "sq_quick.yaml", t / "out"],
        r"SmoothQuant cannot map GPT2LMHeadModel: no decoder layers at model\.model\.layers",
    ),
    "smoothquant_function": _quantize_tiny(
        "sq_quick.yaml",
        r"SmoothQuant changed the logits of QuantkitForCausalLM: .* above the tolerance",
        _break_the_norm_fold,
    ),
    "llmcompressor_missing": Row(
        "quantize",
        lambda p, t: ["quantize", p.tiny, "fp8_block_ct", t / "out"],
        r"llmcompressor environment not found at /nonexistent/python: run `make setup-llmcompressor`",
        lambda p, mp: mp.setenv("QUANTKIT_LLMCOMPRESSOR_PYTHON", "/nonexistent/python"),
    ),
    "llmcompressor_failed": Row(
        "quantize",
        lambda p, t: ["quantize", p.tiny, "fp8_block_ct", t / "out"],
        r"llmcompressor failed on .* with recipe fp8_block_ct \(worker .*, exit 3\); the end of its "
        r"stderr:\nloading the model\nValueError: scheme FP8_BLOCK: injected failure",
        _fake_llmcompressor_python,
    ),
    "llmcompressor_awq_zoo": Row(
        "quantize",
        lambda p, t: ["quantize", p.tiny, "nvfp4_ct_awq", t / "out"],
        r"recipe nvfp4_ct_awq: llm-compressor's AWQModifier runs in its sequential pipeline, whose fx tracing does "
        r"not wrap quantkit's own 'quantkit' models",
        _fake_llmcompressor_python,
    ),
    "modelopt_missing": Row(
        "quantize",
        lambda p, t: ["quantize", p.tiny, "nvfp4_modelopt", t / "out"],
        r"recipe nvfp4_modelopt needs nvidia-modelopt \(.*\): pip install -e '\.\[backends\]'",
        lambda p, mp: mp.setitem(sys.modules, "modelopt.torch.quantization", None),
    ),
    "modelopt_failed": Row(
        "quantize",
        lambda p, t: ["quantize", p.tiny, "nvfp4_modelopt", t / "out"],
        r"modelopt failed on .* with recipe nvfp4_modelopt: RuntimeError: injected calibration failure",
        _fail_modelopt_calibration,
    ),
    "quality_not_quantized": Row(
        "quality",
        lambda p, t: ["quality", p.tiny, p.tiny],
        r"has no quantization_config \(not a quantized checkpoint\)",
    ),
    "diagnose_quantized": Row(
        "diagnose",
        lambda p, t: ["diagnose", p.fake_quantized, "--out", t / "d"],
        r"is a quantized checkpoint; diagnose its unquantized source",
    ),
    "diagnose_recipe": _diagnose_tiny("w4a4_nvfp4_sq", r"recipe 'w4a4_nvfp4_sq' applies SmoothQuant first"),
    "diagnose_gptq": _diagnose_tiny(
        "w4a4_nvfp4_gptq", r"recipe 'w4a4_nvfp4_gptq' rounds its weights by GPTQ, which needs calibration"
    ),
    "diagnose_nan": Row(
        "diagnose",
        lambda p, t: [
            "diagnose",
            p.nan_weights,
            "--num-sequences",
            "1",
            "--seq-len",
            "16",
            "--recipes",
            "--out",
            t / "d",
        ],
        r"non-finite value",
    ),
    "eval_unknown_suite": Row(
        "eval", lambda p, t: ["eval", p.tiny, "--suite", "nope"], r"unknown suite 'nope'; known: "
    ),
    "eval_no_items": Row(
        "eval",
        lambda p, t: ["eval", p.tiny, "--out", t / "eval"],
        r"offline eval items missing or stale in .*: run `make setup`",
        lambda p, mp: mp.setenv("QUANTKIT_EVAL_DATA", str(p.root / "no_eval_data")),
    ),
    "report_schema": Row(
        "report", lambda p, t: ["report", p.root / "results.json", "--out", t / "r"], r"'rows' must be a non-empty list"
    ),
    "report_missing": Row("report", lambda p, t: ["report", t / "none.json"], r"none\.json: no such file"),
    "gate_thresholds": Row(
        "gate",
        lambda p, t: ["gate", "--baseline", PAPER, "--current", PAPER, "--config", p.root / "gate.yaml"],
        r"unknown threshold\(s\) nope",
    ),
    "gate_missing_row": Row(
        "gate",
        lambda p, t: ["gate", "--baseline", PAPER, "--current", p.root / "current.json"],
        r"current\.json: missing row variant",
    ),
    "run_spec_key": Row("run", lambda p, t: ["run", p.root / "spec.yaml"], r"spec\.yaml: unknown key\(s\) \['nope'\]"),
    "run_spec_calibration": Row(
        "run",
        lambda p, t: ["run", p.root / "spec_calibration.yaml"],
        r"spec_calibration\.yaml: calibration needs num_sequences >= 1 and seq_len >= 2, got 0, 512",
    ),
    "run_spec_missing": Row("run", lambda p, t: ["run", t / "none.yaml"], r"pipeline spec .*none\.yaml does not exist"),
    "run_stage_bad_input": Row(
        "run",
        lambda p, t: ["run", DEFAULT_SPEC, "--model", p.no_tokenizer, "--run-dir", t / "run", "--until", "quantize"],
        r"stage '\w+' failed for model 'no_tokenizer'.*tokenizer",
    ),
    "run_dir_locked": Row(
        "run",
        lambda p, t: ["run", DEFAULT_SPEC, "--model", p.tiny, "--run-dir", p.root / "locked_run"],
        r"run directory .* is in use by another quantkit process \(pid \d+",
        lambda p, mp: exclusive_lock(p.root / "locked_run" / ".lock", "this test"),
    ),
    "run_ray_missing": Row(
        "run",
        lambda p, t: ["run", DEFAULT_SPEC, "--model", p.tiny, "--run-dir", t / "run", "--executor", "ray"],
        r"--executor ray needs ray \(.*\): pip install 'quantkit\[ray\]'",
        lambda p, mp: mp.setitem(sys.modules, "ray", None),
    ),
    "run_ray_unreachable": Row(
        "run",
        lambda p, t: [
            "run",
            DEFAULT_SPEC,
            "--model",
            p.tiny,
            "--run-dir",
            t / "run",
            "--executor",
            "ray",
            "--address",
            "127.0.0.1:1",
        ],
        r"cannot reach a Ray cluster at 127\.0\.0\.1:1: .*is `ray start --head` running there",
    ),
    "run_ray_data_parallel": Row(
        "run",
        lambda p, t: ["run", p.root / "dp_spec.yaml", "--model", p.tiny, "--run-dir", t / "run", "--executor", "ray"],
        r"parallel\.data_parallel_size is 2: .*set data_parallel_size: 1",
    ),
    "run_address_without_ray": Row(
        "run", lambda p, t: ["run", DEFAULT_SPEC, "--address", "auto"], r"--address .* needs --executor ray"
    ),
    # issue 50: validated before any work
    "quantize_into_source": Row(
        "quantize",
        lambda p, t: ["quantize", p.tiny, "w4a4_nvfp4", p.tiny, "--overwrite"],
        r"output .* is the input .*: write the result somewhere else",
    ),
    "quantize_inside_source": Row(
        "quantize", lambda p, t: ["quantize", p.tiny, "w4a4_nvfp4", p.tiny / "q"], r"output .* lies inside the input"
    ),
    "quantize_onto_file": Row(
        "quantize",
        lambda p, t: ["quantize", p.tiny, "w4a4_nvfp4", p.root / "a_file", "--overwrite"],
        r"output .*a_file is a file, not a directory",
    ),
    "quantize_under_file": Row(
        "quantize",
        lambda p, t: ["quantize", p.tiny, "w4a4_nvfp4", p.root / "a_file" / "out"],
        r"cannot create .*: .*a_file is a file, not a directory",
    ),
    "quantize_missing_layer": Row(
        "quantize",
        lambda p, t: ["quantize", p.more_layers, "w4a4_nvfp4", t / "out"],
        r"config\.json does not match the weights: 11 tensor\(s\) the config declares are "
        r"missing \(e\.g\. model\.layers\.2\.",
    ),
    "quantize_streaming_missing_layer": Row(
        "quantize",
        lambda p, t: ["quantize", p.more_layers, "w4a4_nvfp4", t / "out", "--streaming"],
        r"config\.json does not match the weights: 11 tensor",
    ),
    "quantize_mlp_shape": Row(
        "quantize",
        lambda p, t: ["quantize", p.wider_mlp, "w4a4_nvfp4", t / "out"],
        r"tensor\(s\) of another shape \(e\.g\. model\.layers\.0\.mlp\.\w+_proj\.weight is "
        r"\(\d+, \d+\) in the weights, \(\d+, \d+\) by config\.json",
    ),
    "recipe_yaml_syntax": _quantize_tiny("syntax.yaml", r"syntax\.yaml: not valid YAML \(line \d+, column \d+\)"),
    "spec_yaml_syntax": Row(
        "run",
        lambda p, t: ["run", p.root / "spec_syntax.yaml"],
        r"spec_syntax\.yaml: not valid YAML \(line \d+, column \d+\)",
    ),
    "recipe_alpha_type": _quantize_tiny(
        "alpha_half.yaml", r"alpha_half\.yaml: smoothquant\.alpha must be a number, got 'half'"
    ),
    "recipe_block_size_type": _quantize_tiny("block_words.yaml", r"gptq\.block_size must be an integer, got 'sixteen'"),
    "recipe_dampening_type": _quantize_tiny("dampening_words.yaml", r"gptq\.dampening must be a number, got 'lots'"),
    "recipe_dampening_range": _quantize_tiny("dampening_negative.yaml", r"gptq\.dampening must be > 0 .*, got -1"),
    "quality_garbage_config": Row(
        "quality",
        lambda p, t: ["quality", p.tiny, p.garbage_qc],
        r"quantization_config must be an object with a quant_method string, got 'garbage'",
    ),
    "generate_garbage_config": Row(
        "generate", lambda p, t: ["generate", p.garbage_qc, "hello"], r"quantization_config must be an object"
    ),
    "eval_garbage_config": Row(
        "eval", lambda p, t: ["eval", p.garbage_qc, "--out", t / "e"], r"quantization_config must be an object"
    ),
    "quality_scheme_vs_tensors": Row(
        "quality",
        lambda p, t: ["quality", p.tiny, p.fp8_says_nvfp4],
        r"quantized module .* \(nvfp4\) has no tensor .*weight_packed",
    ),
    "quality_other_source": Row(
        "quality",
        lambda p, t: ["quality", p.other, p.fp8],
        r"fp8 was quantized from .*, not from .*other_model .*: pass its source, or --any-source",
    ),
    "quality_peer_format": Row(
        "quality",
        lambda p, t: ["quality", p.tiny, p.ct_fp8, "--any-source"],
        r"compressed-tensors format\(s\) \['float-quantized'\]: quality reads a peer's nvfp4-pack-quantized",
    ),
    "quality_peer_tensors": Row(
        "quality",
        lambda p, t: ["quality", p.tiny, p.ct_nvfp4_unpacked, "--any-source"],
        r"ct_nvfp4: not an NVFP4 checkpoint with static activation scales: no module stores weight_packed",
    ),
    "quality_peer_transforms": Row(
        "quality",
        lambda p, t: ["quality", p.tiny, p.ct_nvfp4_rotated, "--any-source"],
        r"ct_nvfp4_rotated: the checkpoint folds compressed-tensors transforms \['R1'\] into its weights .* quality "
        r"reads a peer's checkpoints without transforms only",
    ),
    "quality_data_missing": Row(
        "quality",
        lambda p, t: ["quality", p.tiny, p.fp8, "--data", t / "missing.txt"],
        r"calibration file .*missing\.txt not found",
    ),
    "quality_quantized_source": Row(
        "quality", lambda p, t: ["quality", p.fp8, p.fp8], r"fp8 is a quantized checkpoint"
    ),
    "eval_hf_raw_quantized": Row(
        "eval",
        lambda p, t: ["eval", p.fp8_no_qc, "--backend", "hf", "--out", t / "e"],
        r"the weights hold quantized tensors .* but config\.json has no quantization_config",
    ),
    "eval_hf_quantkit": Row(
        "eval",
        lambda p, t: ["eval", p.fp8, "--backend", "hf", "--out", t / "e"],
        r"fp8 is a quantkit checkpoint \(fp8_block\): --backend hf .* evaluates unquantized "
        r"checkpoints only",
    ),
    "gguf_cut_header": Row(
        "import-gguf",
        lambda p, t: ["import-gguf", p.root / "cut_header.gguf", t / "out"],
        r"cut_header\.gguf: truncated or corrupt GGUF file \(4000 bytes",
    ),
    "gguf_cut_half": Row(
        "import-gguf",
        lambda p, t: ["import-gguf", p.root / "cut_half.gguf", t / "out"],
        r"cut_half\.gguf: truncated or corrupt GGUF file",
    ),
    "zoo_steps": Row(
        "zoo",
        lambda p, t: ["zoo", "build", "ga", "--steps", "-3", "--out", t / "zoo"],
        r"steps must be a positive integer .*, got -3",
    ),
    "run_spec_suite": Row(
        "run", lambda p, t: ["run", p.root / "spec_suite.yaml"], r"spec_suite\.yaml: eval\.suite: unknown suite"
    ),
    "run_spec_hf_quantized": Row(
        "run",
        lambda p, t: ["run", p.root / "spec_hf.yaml"],
        r"eval\.backend hf \(transformers\) evaluates unquantized checkpoints only; recipes \[",
    ),
    "run_allow_code": Row(
        "run",
        lambda p, t: ["run", p.root / "spec_code.yaml"],
        r"eval\.allow_code is true, so this study executes model-written code .*--allow-code-execution",
        lambda p, mp: mp.delenv("QUANTKIT_ALLOW_CODE_EXECUTION", raising=False),
    ),
    "zoo_preset": Row(
        "zoo", lambda p, t: ["zoo", "build", "ga", "nope", "--out", t / "zoo"], r"unknown zoo variant\(s\) \['nope'\]"
    ),
    "zoo_size": Row(
        "zoo", lambda p, t: ["zoo", "build", "ga", "--size", "huge", "--out", t / "zoo"], r"unknown zoo size 'huge'"
    ),
}


@pytest.mark.parametrize("name", ROWS)
def test_named_error(inputs, capsys, monkeypatch, tmp_path, name):
    row = ROWS[name]
    held = row.setup(inputs, monkeypatch) if row.setup is not None else None
    with held or contextlib.nullcontext():
        code, _, err = _run(capsys, row.argv(inputs, tmp_path))
    _assert_named_error(code, err, row.command, row.match)


def test_usage_errors_are_argparse_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["quantize", "only-a-model"])
    assert exit_.value.code == 2
    assert "quantkit quantize: error: the following arguments are required: recipe, out" in capsys.readouterr().err


def test_code_execution_refused_is_a_named_error(monkeypatch):
    """Library only: `quantkit eval` skips code benchmarks unless --allow-code-execution is given."""
    from quantkit.evals.execution import ALLOW_ENV, CodeExecutionRefused, run_program

    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(CodeExecutionRefused, match="--allow-code-execution") as err:
        run_program("pass")
    assert isinstance(err.value, QuantkitError)


def test_the_source_is_never_overwritten(inputs, capsys):
    """`quantize SRC RECIPE SRC --overwrite` is refused before any work and leaves every source file as it was."""
    before = {f.name: f.read_bytes() for f in inputs.tiny.iterdir() if f.is_file()}
    code, _, err = _run(capsys, ["quantize", inputs.tiny, "w4a4_nvfp4", inputs.tiny, "--overwrite"])
    _assert_named_error(code, err, "quantize", r"is the input")
    assert {f.name: f.read_bytes() for f in inputs.tiny.iterdir() if f.is_file()} == before


def test_the_quantized_checkpoint_records_its_source(inputs):
    """quantkit_source.json names the source and its weights' fingerprint; `quality --any-source` accepts another."""
    from quantkit.checkpoints import source_record, weights_fingerprint

    record = source_record(inputs.fp8)
    assert record == {"path": str(inputs.tiny.resolve()), "fingerprint": weights_fingerprint(inputs.tiny)}
    assert weights_fingerprint(inputs.other) != record["fingerprint"]  # same architecture, other weights
    from quantkit.quantize.quality import check_source

    check_source(inputs.other, [inputs.fp8], any_source=True)  # no error: the user asked


def test_import_gguf_honours_its_bos_flag(inputs, tmp_path):
    """A GGUF with tokenizer.ggml.add_bos_token true imports to a tokenizer that adds BOS (transformers' GGUF
    conversion alone drops the flag), recorded in import.json; without the flag nothing is added."""
    from transformers import AutoTokenizer

    from quantkit.models.trained import import_gguf

    out = import_gguf(inputs.root / "tiny.gguf", tmp_path / "bos")
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("hello world").input_ids[0] == tokenizer.bos_token_id == 0
    assert json.loads((out / "import.json").read_text())["tokenizer"] == {"add_bos_token": True}
    plain = write_tiny_qwen2_gguf(tmp_path / "plain.gguf", inputs.tiny / "tokenizer.json", add_bos=None)
    out = import_gguf(plain, tmp_path / "plain")
    assert AutoTokenizer.from_pretrained(out)("hello world").input_ids[0] != 0
    assert json.loads((out / "import.json").read_text())["tokenizer"] == {}


def test_quantize_prints_its_path_and_estimate_first(inputs, capsys, tmp_path):
    """The chosen path and the whole-model estimate are printed before the work (the first line after the
    calibration costs), and a recipe that calibrates is estimated above plain rounding."""
    from quantkit.quantize.checkpoint import float32_bytes, whole_model_bytes
    from quantkit.quantize.recipe import load_recipe

    assert main(["quantize", str(inputs.tiny), "w4a4_nvfp4", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"quantize: whole-model \(peak ~[\d.]+ GB\); the whole-model path would need", out), out
    plain, calibrated = (whole_model_bytes(inputs.tiny, load_recipe(r)) for r in ("w4a4_nvfp4", "w4a4_nvfp4_sq_gptq"))
    assert plain >= 2 * float32_bytes(inputs.tiny) and calibrated > plain
