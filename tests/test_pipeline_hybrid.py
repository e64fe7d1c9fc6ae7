"""The deployment study end to end on a tiny hybrid MoE checkpoint (Qwen3-Next shape: 3 Gated DeltaNet + 1 gated
softmax layer, 8 routed experts top-2 + a shared expert): diagnose (softmax-only sinks, per-expert load) ->
quantize (experts per expert matrix) -> vLLM in bfloat16 with quantkit's FusedMoE method + lm-eval (smoke suite)
-> degradation with KL -> report, whose section heading names the architecture. The dense path is
tests/test_pipeline.py; this one runs the same stages on the paper's own architecture.
"""

from __future__ import annotations

import json

import pytest

from quantkit.models.tiny_hybrid import build_tiny_hybrid_checkpoint
from quantkit.pipelines.study import Study, load_spec

pytestmark = pytest.mark.slow

SPEC = """
name: tiny-hybrid
models: {{hybrid: {model}}}
recipes: [bf16, w8a8_fp8_block]
eval: {{suite: smoke, limit: 2, dtype: bfloat16}}
kl: {{num_sequences: 4, seq_len: 64}}
diagnose: {{num_sequences: 4, seq_len: 64}}
runs_dir: {runs}
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid_study")
    model = build_tiny_hybrid_checkpoint(tmp / "hybrid", attn_output_gate="headwise", gated_norm_rank=16)
    spec = tmp / "spec.yaml"
    spec.write_text(SPEC.format(model=model, runs=tmp / "runs"))
    return Study(load_spec(spec)).run()


def test_hybrid_study_end_to_end(run_dir):
    results = json.loads((run_dir / "results.json").read_text())
    rows = {r["recipe"]: r for r in results["rows"]}
    assert set(rows) == {"bf16", "w8a8_fp8_block"} and rows["w8a8_fp8_block"]["precision"] == "W8A8"
    section = "QuantkitHybridForCausalLM: 3 Gated DeltaNet + 1 softmax layers, MoE 8 experts top-2 + shared"
    assert all(r["section"] == section for r in rows.values())
    assert section in (run_dir / "report" / "report.md").read_text()  # the report marks the architecture
    quantized = rows["w8a8_fp8_block"]
    assert quantized["kl"] > 0 and set(quantized["noise_floor"]) == set(quantized["scores"])

    checkpoint = run_dir / "checkpoints" / "hybrid-w8a8_fp8_block"
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.experts.7.down_proj" in config["quantized_modules"]  # routed experts quantized
    assert "model.layers.0.linear_attn.in_proj_qkvz" in config["quantized_modules"]  # and DeltaNet's projection
    evaluated = json.loads((run_dir / "evals" / "hybrid-w8a8_fp8_block" / "results.json").read_text())
    assert evaluated["settings"]["dtype"] == "bfloat16"  # vLLM's CPU Gated DeltaNet runs bf16 only

    diagnostics = json.loads((run_dir / "diagnostics" / "hybrid" / "diagnostics.json").read_text())
    assert diagnostics["attention"]["layers"] == [3]  # sink statistics on the softmax layer only
    assert len(diagnostics["experts"]) == 4  # per-expert load and maxima in every MoE layer


def test_embedded_default_spec_is_the_hybrid_trio():
    """pipelines/default.yaml (the embedded default study, docs/hybrid.md) names the zoo's hybrid Table 2 group,
    evaluated in bf16 (vLLM's CPU Gated DeltaNet runs bf16 only); pipelines/table2-dense.yaml keeps the dense trio."""
    from pathlib import Path

    from quantkit.models import zoo

    pipelines = Path(__file__).parents[1] / "pipelines"
    spec = load_spec(pipelines / "default.yaml")
    assert spec.name == "default"
    assert sorted(spec.models.values()) == sorted(f"zoo:{p}" for p in zoo.GROUPS["table2-hybrid"])
    assert all(zoo.family(p.removeprefix("zoo:")) == "hybrid" for p in spec.models.values())
    assert spec.eval["dtype"] == "bfloat16" and spec.recipes[0] == "bf16"
    dense = load_spec(pipelines / "table2-dense.yaml")
    assert sorted(dense.models.values()) == sorted(f"zoo:{p}" for p in zoo.GROUPS["table2"])
    assert dense.recipes == spec.recipes and dense.eval["suite"] == spec.eval["suite"] == "mini"
