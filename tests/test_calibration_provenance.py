"""Calibration sets (quantkit.quantize.provenance, docs/calibration.md): the recipes default to paper 000's
count for SmoothQuant (4096 sequences x 512 tokens), a study's `calibration` key resizes every set (the
offline default study and CI run 256 x 512), and each results row records the set its checkpoint was made
with (read back from the quantized checkpoint). Cost: one tiny-checkpoint quantization with 4 x 32 tokens
of SmoothQuant calibration (~5 s on 2 cores); everything else reads YAML."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from quantkit.calibrate.stats import PAPER_NUM_SEQUENCES
from quantkit.data import describe_calibration_source
from quantkit.pipelines.study import Study, load_spec
from quantkit.quantize.provenance import apply_calibration, calibration_sets, checkpoint_calibration, with_calibration
from quantkit.quantize.recipe import available_recipes, load_recipe
from quantkit.report.render import describe_calibration as describe

PIPELINES = Path(__file__).resolve().parents[1] / "pipelines"


def test_smoothquant_recipes_default_to_the_paper_count():
    sq = [name for name in available_recipes() if load_recipe(name).smoothquant is not None]
    assert sorted(sq) == [
        "mixed_fp8_attn_nvfp4_sq_gptq",
        "mixed_fp8_attn_nvfp4_sq_gptq_mse",
        "mixed_fp8_attn_nvfp4_sq_search_gptq_mse",
        "w4a4_nvfp4_46_had16_awq_gptq_mse",
        "w4a4_nvfp4_awq",
        "w4a4_nvfp4_awq_gptq_mse",
        "w4a4_nvfp4_sq",
        "w4a4_nvfp4_sq_gptq",
        "w4a4_nvfp4_sq_gptq_actorder",
        "w4a4_nvfp4_sq_mse",
        "w4a4_nvfp4_sq_noexperts",
        "w4a4_nvfp4_sq_search",
        "w4a4_nvfp4_sq_updown",
        "w4a4_nvfp4_sq_updown_gptq_mse",
        "w4a4_nvfp4_static_awq",
        "w4a4_nvfp4_static_awq_parent",
        "w4a4_nvfp4_static_awq_wonly",
        "w4a4_nvfp4_static_awq_wonly_gptq_mse",
        "w8a8_fp8_block_sq",
    ]
    for name in sq:  # SmoothQuant's scales: the paper's count; AWQ's: llm-compressor's examples' 256 x 512
        rule = load_recipe(name).smoothquant.scales  # names the set: "smoothquant" or "awq"
        count = 256 if rule == "awq" else PAPER_NUM_SEQUENCES
        assert calibration_sets(load_recipe(name))[0] == (  # a model of no known type: prose and code
            dict(use=rule, source=describe_calibration_source("speeches+code"), num_sequences=count, seq_len=512)
        )
    assert [s["use"] for s in calibration_sets(load_recipe("w4a4_nvfp4_sq_gptq"))] == ["smoothquant", "gptq"]
    assert PAPER_NUM_SEQUENCES == 4096  # paper 000 App. A.4.2
    # recipes with dynamic activations and no SmoothQuant draw nothing; static scales draw their own set
    assert calibration_sets(load_recipe("bf16")) == calibration_sets(load_recipe("w4a4_nvfp4")) == []
    assert describe(calibration_sets(load_recipe("w4a4_nvfp4_static"), max_positions=128)) == "64x128 scales"
    assert describe(calibration_sets(load_recipe("fp8_block_ct"))) == "none"  # llmcompressor FP8_BLOCK: dynamic
    assert describe(calibration_sets(load_recipe("nvfp4_ct_gptq"))) == "128x512 gptq+scales"  # one set, two uses
    assert describe(calibration_sets(load_recipe("nvfp4_ct_awq"))) == "64x512 awq+scales"
    assert describe(calibration_sets(load_recipe("nvfp4_ct_awq_gptq"))) == "128x512 awq+gptq+scales"  # GPTQ's
    assert describe(calibration_sets(load_recipe("w4a4_nvfp4_awq"))) == "256x512 awq"  # quantkit's AWQ: its own name


def test_a_study_resizes_every_calibration_set():
    for spec_file in ("default.yaml", "table2-dense.yaml"):  # the cheap setting of the offline studies
        assert load_spec(PIPELINES / spec_file).calibration == {"num_sequences": 256, "seq_len": 512}
    study = Study(load_spec(PIPELINES / "default.yaml"))
    assert describe(calibration_sets(study.recipe("w4a4_nvfp4_sq"))) == "256x512 SQ"
    assert study.recipe("w4a4_nvfp4") == load_recipe("w4a4_nvfp4")  # nothing to resize
    assert describe(calibration_sets(with_calibration(load_recipe("nvfp4_modelopt"), 8, 64))) == "8x64 scales"
    with pytest.raises(ValueError, match="num_sequences >= 1"):
        with_calibration(load_recipe("w4a4_nvfp4_sq"), 0, 512)
    # the source and the early stop, alone or with the counts
    recipe = apply_calibration(load_recipe("w4a4_nvfp4_sq"), {"data": "code", "early_stop": None})
    assert recipe.calibration_data == "code" and recipe.smoothquant.early_stop is None
    assert recipe.smoothquant.num_sequences == load_recipe("w4a4_nvfp4_sq").smoothquant.num_sequences
    assert calibration_sets(recipe)[0]["source"] == describe_calibration_source("code")
    assert apply_calibration(load_recipe("w4a4_nvfp4"), {"early_stop": 0.05}) == load_recipe("w4a4_nvfp4")


def test_the_trained_model_study_loads():
    """pipelines/real.yaml: both trained models, SmoothQuant on prose + code with the early stop, the code suite
    (HumanEval and MBPP in their instruct form through each model's chat template) executed, SmolLM2 on the first
    1000 items of each commonsense set it answers above chance, the numerics floor and the coder's reference protocol
    on; its suites resolve."""
    from quantkit.evals.suite import load_suite

    spec = load_spec(PIPELINES / "real.yaml")
    assert set(spec.models.values()) == {"model:qwen2.5-coder-0.5b-instruct", "model:smollm2-135m-instruct"}
    recipe = Study(spec).recipe("w4a4_nvfp4_sq")
    assert (recipe.calibration_data, recipe.smoothquant.early_stop, recipe.smoothquant.num_sequences) == (
        "speeches+code",
        0.02,
        256,
    )
    suite = load_suite(spec.eval["suite"])
    assert spec.eval["allow_code"] and suite.chat_template
    assert suite.tasks(allow_code=True) == ["qk_humaneval_instruct", "qk_mbpp_500_instruct"]
    study = Study(spec)
    assert (
        study.suite("smollm") == "commonsense-small" and study.limit("smollm") == 1000 and study.limit("coder") is None
    )
    assert spec.eval["numerics"] and spec.eval["reference"] and study.reference("coder").suite == "code-evalplus"
    one = Study(load_spec(PIPELINES / "real.yaml", "model:smollm2-135m-instruct"))  # --model keeps its own limit
    assert one.limit("smollm2-135m-instruct") == 1000 and one.suite("smollm2-135m-instruct") == "commonsense-small"


def test_the_method_comparison_study_loads_with_one_label_per_method():
    """pipelines/methods.yaml (issue 31 item 5): every method's recipe on the coder, the study's calibration sizing
    SmoothQuant's and GPTQ's windows alike, and a distinct row label per method (the report's precision column)."""
    from quantkit.pipelines.study import _precision

    spec = load_spec(PIPELINES / "methods.yaml")
    study = Study(spec)
    sq_gptq = study.recipe("w4a4_nvfp4_sq_gptq")
    assert (sq_gptq.smoothquant.num_sequences, sq_gptq.gptq.num_sequences, sq_gptq.gptq.seq_len) == (32, 32, 256)
    labels = [_precision(r) for r in spec.recipes]
    assert labels[:2] == ["BF16", "W4A4"]  # the baseline rows first, then the methods in the order of what they tell
    assert sorted(labels) == sorted(
        [
            "BF16",
            "W4A4",
            "W4A4+MSE",
            "W4A4+GPTQ",
            "W4A4+SQ",
            "W4A4+SQ+GPTQ",
            "W4A4+Rot",
            "W4A4+Rot+GPTQ",
            "W4A4+Rot16+MSE+GPTQ",
            "W4A4+Had16+MSE+GPTQ",
            "W4A4+Had16+4/6+MSE+GPTQ",
            "W4A4+Had16+AWQ+4/6+MSE+GPTQ",
            "W4A4+AWQ",
            "W4A4+AWQ+MSE+GPTQ",
            "W4A4+4/6",
            "W4A4/W8A8",
            "W4A4/W8A8/BF16@5b",
            "nvfp4_ct_gptq",
            "nvfp4_ct_awq",
            "nvfp4_ct_awq_gptq",
            "nvfp4_ct_spinquant16_gptq",
            "nvfp4_ct",
            "nvfp4_modelopt_mse",
            "nvfp4_modelopt_awq",
            "W4A4 (static)",
            "W4A4+AWQ (static)",
            "W4A4+AWQ(W) (static)",
            "W4A4+AWQ(W)+MSE+GPTQ (static)",
            "W4A4+AWQ(parent) (static)",
        ]
    )


def test_the_smollm_method_comparison_loads_with_one_label_per_method():
    """pipelines/methods-smollm.yaml: SmolLM2 on the commonsense sets it answers above chance (by log-likelihood: no
    code executed), 1000 items of each as in real.yaml, the same calibration sizing as methods.yaml, a distinct row
    label per method, and every method of methods.yaml among its rows."""
    from quantkit.pipelines.study import _precision

    spec = load_spec(PIPELINES / "methods-smollm.yaml")
    study = Study(spec)
    assert set(spec.models.values()) == {"model:smollm2-135m-instruct"}
    assert spec.eval["suite"] == "commonsense-small" and spec.eval["limit"] == 1000 and not spec.eval.get("allow_code")
    sq_gptq = study.recipe("w4a4_nvfp4_sq_gptq")
    assert (sq_gptq.smoothquant.num_sequences, sq_gptq.gptq.num_sequences, sq_gptq.gptq.seq_len) == (32, 32, 256)
    labels = [_precision(r) for r in spec.recipes]
    assert len(set(labels)) == len(labels) and labels[0] == "BF16"
    coder_methods = load_spec(PIPELINES / "methods.yaml").recipes
    assert set(coder_methods) <= set(spec.recipes), "every method of the coder's comparison has a SmolLM2 row"


@pytest.mark.parametrize(
    "calibration, message",
    [
        ({"num_sequences": 256}, "num_sequences and seq_len together"),
        ({"num_sequences": 256, "seq_len": 1}, "seq_len >= 2"),
        ({"data": ""}, "calibration source string"),
        ({"early_stop": "soon"}, "tolerance >= 0 or null"),
        ({"speed": 1}, r"unknown calibration key\(s\) \['speed'\]"),
    ],
)
def test_a_bad_study_calibration_fails_on_load(calibration, message, tmp_path):
    spec = yaml.safe_load((PIPELINES / "default.yaml").read_text()) | {"calibration": calibration}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(ValueError, match=message):
        load_spec(tmp_path / "bad.yaml")


def test_the_row_records_the_set_the_checkpoint_was_made_with(tiny_checkpoint, tmp_path):
    from quantkit.quantize.checkpoint import quantize_checkpoint

    recipe = with_calibration(load_recipe("w4a4_nvfp4_sq"), 4, 32)
    out = quantize_checkpoint(tiny_checkpoint, recipe, tmp_path / "sq", streaming=False)
    # read from the checkpoint's smoothquant.json, not the recipe: the paper-count recipe still reads 4 x 32
    assert checkpoint_calibration(load_recipe("w4a4_nvfp4_sq"), out) == [
        dict(use="smoothquant", source=describe_calibration_source("speeches"), num_sequences=4, seq_len=32)
    ]


def test_a_smoothquant_row_shows_its_own_outlier_figures(tiny_checkpoint, tmp_path):
    """The study's SQ rows carry max |X| over the smoothed linears' inputs before and after the fold, read from the
    checkpoint's smoothquant.json; a checkpoint without SmoothQuant adds none (its row keeps the source's)."""
    from quantkit.pipelines.study import _smoothed_inputs
    from quantkit.quantize.checkpoint import quantize_checkpoint

    sq = quantize_checkpoint(
        tiny_checkpoint, with_calibration(load_recipe("w4a4_nvfp4_sq"), 4, 32), tmp_path / "sq", streaming=False
    )
    mappings = json.loads((sq / "smoothquant.json").read_text())["mappings"]
    figures = _smoothed_inputs(sq)
    assert figures == {
        "smoothed_input_max_before": max(m["act_max_before"] for m in mappings),
        "smoothed_input_max_after": max(m["act_max_after"] for m in mappings),
    }
    assert all(math.isfinite(v) and v > 0 for v in figures.values())
    plain = quantize_checkpoint(tiny_checkpoint, load_recipe("w4a4_nvfp4"), tmp_path / "plain", streaming=False)
    assert _smoothed_inputs(plain) == {}


@pytest.mark.parametrize("path", sorted(PIPELINES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_pipeline_spec_loads(path):
    """Every spec under pipelines/ loads (recipes, suites, calibration, eval keys checked before any work); the quick
    path keeps to the first items: the coder 40 per task, SmolLM2 100."""
    spec = load_spec(path)
    assert spec.models and "bf16" in spec.recipes  # load_spec raised nothing: every name and key resolved
    if path.name == "real-quick.yaml":
        study = Study(spec)
        assert (study.limit("coder"), study.limit("smollm")) == (40, 100) and spec.eval["numerics"]
