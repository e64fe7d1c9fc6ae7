"""Streaming quantization (`quantkit.quantize.streaming`): the same tensors as the whole-model path, one layer in
memory.

Exactness, not tolerance: the streaming path runs every decoder layer with the same float32 operations, on the same
batches (8 windows) and the same keyword arguments as the whole model's forward does, reads the same values (bf16 or
float32 -> float32 is exact), and calls the same statistics, factor, fold and encode functions. On one machine
and thread count the float32 results are then the same bits, so every assertion below is `torch.equal` on the
raw bytes (and equality of config.json and smoothquant.json), for every recipe, on the dense and the hybrid MoE
tiny models, with hidden states spilled to disk or kept in memory and with the output cut into several shards.

The memory test runs both paths in a subprocess whose address space (RLIMIT_AS) is capped at what it uses after a
warm-up run on a tiny checkpoint plus half the model's float32 size. The whole-model path needs at least the float32
size (its parameters; it also keeps a float32 copy of the state) and must fail; the streaming path needs one layer
in float32 (~1/16 of the model here) plus its encoded tensors and must pass.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_benchmarks import run_benchmark

from quantkit.calibrate import mappings as mappings_module
from quantkit.calibrate.smoothquant import FunctionPreservationError
from quantkit.checkpoints import CheckpointError, TensorReader, read_state, tensor_headers, weight_files
from quantkit.models.modeling import QuantkitNorm
from quantkit.quantize.checkpoint import quantize_checkpoint
from quantkit.quantize.fake_quant import load_fake_quant_model
from quantkit.quantize.provenance import with_calibration
from quantkit.quantize.recipe import RotationSettings, load_recipe
from quantkit.quantize.rotation import TOLERANCE as ROTATION_TOLERANCE
from quantkit.quantize.streaming import quantize_streaming
from quantkit.serve.checkpoint_check import check_servable

REPO = Path(__file__).resolve().parents[1]
IDS = torch.tensor([[0, 5, 9, 44, 100, 7, 300, 12, 81, 3]])


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_quantize_memory", REPO / "benchmarks" / "bench_quantize_memory.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_same_checkpoint(whole: Path, streamed: Path) -> None:
    """Every tensor's bytes equal; config.json, smoothquant.json, tokenizer.json equal -- but for a rotated
    checkpoint's function-check figures (rotation.max_logit_change, logit_scale), which each path measures its own
    way (whole forwards; hidden states layer by layer): each must be within the rotation's tolerance."""
    a, b = read_state(whole), read_state(streamed)
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)), name
    configs = [json.loads((d / "config.json").read_text()) for d in (whole, streamed)]
    for config in configs:
        check = config.get("quantization_config", {}).get("rotation")
        if check is not None:
            change, scale = check.pop("max_logit_change"), check.pop("logit_scale")
            assert change <= ROTATION_TOLERANCE * scale, check
    assert configs[0] == configs[1]
    for side in ("smoothquant.json", "tokenizer.json"):
        assert (whole / side).exists() == (streamed / side).exists(), side
        if (whole / side).exists():
            assert (whole / side).read_text() == (streamed / side).read_text(), side


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    from quantkit.models.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("dense") / "m", attn_output_gate="headwise", gated_norm_rank=16, attention_sink=True
    )


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from quantkit.models.tiny_hybrid import build_tiny_hybrid_checkpoint

    return build_tiny_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid") / "m")


# 12 windows: a full batch of 8 and a partial one; spill 0: every stream on disk; 1 MiB shards: several
DENSE = [
    ("bf16", None),
    ("w8a8_fp8_block", None),
    ("w4a4_nvfp4", None),
    ("w4a4_nvfp4_static", 0),
    ("w8a8_fp8_block_sq", None),
    ("w4a4_nvfp4_sq", 0),
    ("w4a4_nvfp4_sq_updown", None),
    ("w4a4_nvfp4_46", None),
]


@pytest.mark.parametrize("recipe_name,spill", DENSE)
def test_dense_streaming_is_bit_identical(dense, tmp_path, recipe_name, spill):
    recipe = with_calibration(load_recipe(recipe_name), 12, 64)
    whole = quantize_checkpoint(dense, recipe, tmp_path / "whole", streaming=False)
    streamed = quantize_streaming(
        dense, recipe, tmp_path / "stream", max_shard_bytes=2**20, **({} if spill is None else {"spill_bytes": spill})
    )
    assert_same_checkpoint(whole, streamed)
    index = json.loads((streamed / "model.safetensors.index.json").read_text())
    files = weight_files(streamed)
    assert len(files) > 1 and [f.name for f in files] == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in read_state(streamed).values())
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "stream",
        "whole",
    ]  # no temporaries or spilled activations left
    if recipe.scheme == "bf16":
        return
    assert check_servable(streamed)["quantized_modules"]
    with torch.no_grad():  # the fake-quant reference reads the shards: the same model as from one file
        assert torch.equal(load_fake_quant_model(streamed)(IDS).logits, load_fake_quant_model(whole)(IDS).logits)


@pytest.mark.parametrize(
    "recipe_name",
    ["w8a8_fp8_block", "w4a4_nvfp4_static", "w4a4_nvfp4_sq", "w4a4_nvfp4_sq_noexperts", "w4a4_nvfp4_sq_updown"],
)
def test_hybrid_moe_streaming_is_bit_identical(hybrid, tmp_path, recipe_name):
    """Gated DeltaNet + softmax layers, routed experts fused in the model and per-expert in the checkpoint (all-experts
    statistics for the static scales, the MoE norm smoothed into router, experts and shared expert)."""
    recipe = with_calibration(load_recipe(recipe_name), 4, 32)
    whole = quantize_checkpoint(hybrid, recipe, tmp_path / "whole", streaming=False)
    streamed = quantize_streaming(hybrid, recipe, tmp_path / "stream", max_shard_bytes=2**20)
    assert_same_checkpoint(whole, streamed)
    assert check_servable(streamed)


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    """A tiny stock Llama with tied embeddings (rotation unties them)."""
    from quantkit.models.tiny import build_tiny_stock_checkpoint

    source = build_tiny_stock_checkpoint(tmp_path_factory.mktemp("llama") / "m", "llama", seed=0)
    state = load_file(str(source / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(source / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    return source


@pytest.mark.parametrize(
    "model,recipe_name",
    [
        ("gated", "w4a4_nvfp4_rot"),  # the zoo's dense family: gated attention, sinks (no GatedNorm: not rotatable)
        ("gated", "w8a8_fp8_block_rot"),  # online block 128
        ("tied", "w4a4_nvfp4_rot_gptq"),  # untied embeddings, GPTQ on the rotated layers
        ("tied", "w4a4_nvfp4_sq+rot"),  # SmoothQuant on the rotated layers, its check through the rotated head
        ("hybrid", "w4a4_nvfp4_rot"),  # Gated DeltaNet, router and experts rotated, the shared expert's online Hadamard
    ],
)
def test_rotation_streaming_is_bit_identical(model, recipe_name, hybrid, tied_llama, tmp_path):
    """Rotation layer by layer: the outside modules rotated in memory first, each layer rotated as it is loaded
    (the same float64 products as the whole-model path, in the same order), so the same bytes."""
    if model == "gated":
        from quantkit.models.tiny import build_tiny_checkpoint

        source = build_tiny_checkpoint(tmp_path / "m", attn_output_gate="headwise", attention_sink=True)
    else:
        source = hybrid if model == "hybrid" else tied_llama
    if recipe_name == "w4a4_nvfp4_sq+rot":
        recipe = dataclasses.replace(load_recipe("w4a4_nvfp4_sq"), name=recipe_name, rotation=RotationSettings())
    else:
        recipe = load_recipe(recipe_name)
    recipe = with_calibration(recipe, 10, 32)
    whole = quantize_checkpoint(source, recipe, tmp_path / "whole", streaming=False)
    streamed = quantize_streaming(source, recipe, tmp_path / "stream", max_shard_bytes=2**20)
    assert_same_checkpoint(whole, streamed)
    rotation = json.loads((streamed / "config.json").read_text())["quantization_config"]["rotation"]
    assert rotation["online_hadamard"] and check_servable(streamed)


def test_streams_hold_no_autograd_graph(dense, tmp_path, monkeypatch):
    """A stream's hidden states carry no autograd graph. The layers' parameters require grad (as loaded), so a
    forward outside no_grad made every output keep its layer's weights alive after `layer.to("meta")`: RSS grew by
    about a layer per layer (SmolLM2-135M, w4a4_nvfp4_sq: 630 MB after layer 0, 2451 MB after layer 29; fixed: 735)."""
    from quantkit.quantize import streaming

    grads = []
    advance = streaming.advance_stream

    def spy(stream, layer, i, *args, **kwargs):
        advance(stream, layer, i, *args, **kwargs)
        assert any(p.requires_grad for p in layer.parameters())  # what made the graph possible
        grads.extend(stream.hidden[b].requires_grad for b in range(len(stream.hidden)))

    monkeypatch.setattr(streaming, "advance_stream", spy)
    quantize_streaming(dense, with_calibration(load_recipe("w4a4_nvfp4_sq"), 4, 32), tmp_path / "s")
    assert grads and not any(grads)


def test_early_stop_ends_the_windows_in_both_paths(dense, tmp_path):
    """SmoothQuant's early stop (`stats.EarlyStop`: >= 32 windows, 2 batches under the tolerance) ends the windows
    at the same batch on the whole-model and streaming paths (bit-identical checkpoints and smoothquant.json);
    an unreachable tolerance (0: every batch moves some maximum on random weights) and null use every window."""
    from quantkit.quantize.provenance import apply_calibration

    base = load_recipe("w4a4_nvfp4_sq")
    settled = apply_calibration(base, {"num_sequences": 64, "seq_len": 32, "early_stop": 1e9})  # settles at once
    whole = quantize_checkpoint(dense, settled, tmp_path / "whole", streaming=False)
    streamed = quantize_streaming(dense, settled, tmp_path / "stream")
    assert_same_checkpoint(whole, streamed)
    report = json.loads((whole / "smoothquant.json").read_text())
    layers = len(report["windows_per_layer"])
    assert (report["windows_drawn"], report["num_sequences"], report["windows_per_layer"]) == (64, 32, [32] * layers)
    for stop in (0.0, None):
        out = quantize_streaming(
            dense,
            apply_calibration(base, {"num_sequences": 64, "seq_len": 32, "early_stop": stop}),
            tmp_path / f"all-{stop}",
        )
        report = json.loads((out / "smoothquant.json").read_text())
        assert (
            report["num_sequences"] == 64
            and report["windows_per_layer"] == [64] * layers
            and report["early_stop"] == stop
        )


def test_function_preservation_failure_writes_nothing(dense, tmp_path, monkeypatch):
    """A fold that is not function-preserving (GatedNorm without its gate fold) fails the carried logit check."""
    monkeypatch.setitem(
        mappings_module._FOLDS, QuantkitNorm, functools.partial(mappings_module.fold_quantkit_norm, fold_gate=False)
    )
    with pytest.raises(FunctionPreservationError, match=r"above the tolerance 0\.001; nothing was written"):
        quantize_streaming(
            dense, with_calibration(load_recipe("w8a8_fp8_block_sq"), 8, 32), tmp_path / "out", spill_bytes=0
        )
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_sharded_readers(dense, tmp_path):
    """TensorReader reads what safetensors reads; an index must agree with its shards."""
    state = load_file(dense / "model.safetensors")
    reader = TensorReader(dense)
    assert set(reader.names) == set(state)
    assert all(torch.equal(reader[k], v) and reader[k].dtype == v.dtype for k, v in state.items())
    names = sorted(state)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((dense / "config.json").read_text())
    save_file({k: state[k] for k in names[:5]}, str(sharded / "a.safetensors"))
    save_file({k: state[k] for k in names[5:]}, str(sharded / "b.safetensors"))
    weight_map = {k: "a.safetensors" if i < 5 else "b.safetensors" for i, k in enumerate(names)}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert set(tensor_headers(sharded)) == set(state) and read_state(sharded).keys() == state.keys()
    weight_map[names[0]] = "b.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=f"weight_map disagrees with the shards for 1 tensor.*{names[0]}"):
        tensor_headers(sharded)
    weight_map[names[0]] = "c.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"lists shard\(s\) \['c.safetensors'\] that do not exist"):
        weight_files(sharded)


def test_cli_streaming_flag(dense, tmp_path):
    quantkit = Path(sys.executable).parent / "quantkit"
    run = subprocess.run(
        [quantkit, "quantize", str(dense), "w8a8_fp8_block", str(tmp_path / "q"), "--streaming"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "q" / "model.safetensors.index.json").exists() and not (
        tmp_path / "q" / "model.safetensors"
    ).exists()
    with pytest.raises(ValueError, match="quantkit's own backend only"):
        quantize_checkpoint(dense, "fp8_block_ct", tmp_path / "ct", streaming=True)


_LIMITED = textwrap.dedent("""
    import resource, sys
    from quantkit.quantize.checkpoint import quantize_checkpoint
    warm, model, out, streaming = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    budget = int(sys.argv[5])
    quantize_checkpoint(warm, "w8a8_fp8_block", out + "-warm", streaming=streaming)  # imports, threads, arenas
    vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + budget, vm + budget))
    quantize_checkpoint(model, "w8a8_fp8_block", out, streaming=streaming)
    print("quantized under", vm + budget)
""")


def test_quantize_under_an_address_space_limit(tmp_path):
    """16 layers (~755 MB in float32); limit: the warmed-up process' address space + 377 MB (half the float32 size)."""
    bench = _bench()
    from quantkit.data import stdlib_docstrings
    from quantkit.models.tokenizer import save_tokenizer, train_bpe_tokenizer

    save_tokenizer(train_bpe_tokenizer(stdlib_docstrings(), bench.SHAPE["vocab_size"]), tmp_path / "tok")
    warm = bench.build_random_checkpoint(tmp_path / "warm", 1, tmp_path / "tok", **bench.QUICK_SHAPE)
    model = bench.build_random_checkpoint(tmp_path / "model", 16, tmp_path / "tok")
    float32_bytes = 2 * sum(f.stat().st_size for f in model.glob("*.safetensors"))
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
    runs = {}
    for path, streaming in (("streaming", "1"), ("whole", "0")):
        runs[path] = subprocess.run(
            [
                sys.executable,
                "-c",
                _LIMITED,
                str(warm),
                str(model),
                str(tmp_path / path),
                streaming,
                str(float32_bytes // 2),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
    assert runs["streaming"].returncode == 0, runs["streaming"].stderr[-3000:]
    assert check_servable(tmp_path / "streaming")["quantized_modules"]
    assert runs["whole"].returncode != 0, "the whole-model path fit under the limit: the test proves nothing"
    assert any(s in runs["whole"].stderr for s in ("can't allocate memory", "MemoryError", "Cannot allocate memory")), (
        runs["whole"].stderr[-3000:]
    )


def test_memory_benchmark_quick(tmp_path):
    result, table = run_benchmark(
        "bench_quantize_memory.py", ["--quick"], tmp_path, "quantize_memory_*_quick", timeout=900
    )
    assert {"machine", "date", "command", "rows", "summary"} <= set(result)
    assert [r["layers"] for r in result["rows"]] == [2, 4]
    assert all(r["streaming_peak_rss_gb"] > 0 and r["whole_peak_rss_gb"] > 0 for r in result["rows"])
    assert "| 4 |" in table


def test_model_without_decoder_layers_is_refused(dense, tmp_path):
    """docs/errors.md: StreamingError names the missing decoder stack (GPT-2 keeps its blocks at transformer.h)."""
    import shutil

    from transformers import GPT2Config, GPT2LMHeadModel

    from quantkit.quantize.streaming import StreamingError

    src = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=600, n_positions=64)).save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(dense / name, src / name)
    with pytest.raises(StreamingError, match=r"GPT2LMHeadModel has no decoder layers at model.model.layers"):
        quantize_checkpoint(src, "w8a8_fp8_block", tmp_path / "out", streaming=True)
    assert not (tmp_path / "out").exists()
