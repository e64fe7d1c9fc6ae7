"""The zoo trains a variant from scratch on the offline corpus, writes its artifacts, and reuses them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantkit.models import zoo

STEPS = 12


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


@pytest.mark.parametrize("variant", zoo.TABLE2_PRESETS)
def test_table2_presets_build(variant, zoo_dir):
    out = zoo.build(variant, zoo_dir=zoo_dir, steps=STEPS)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert {k: getattr(model.config, k) for k in zoo.PRESETS[variant]} == zoo.PRESETS[variant]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["heldout"]["loss"] < json.loads((out / "loss_curve.json").read_text())[0]["loss"]


def test_build_trains_writes_artifacts_and_resumes(zoo_dir):
    steps = STEPS
    out = zoo.build("ga_gatednorm", zoo_dir=zoo_dir, steps=steps)
    assert out == zoo_dir / "ga_gatednorm-tiny"
    metrics = json.loads((out / "metrics.json").read_text())
    curve = json.loads((out / "loss_curve.json").read_text())
    assert len(curve) == steps and (out / "loss_curve.png").stat().st_size > 1000
    vocab = zoo.SIZES["tiny"].vocab_size
    assert curve[0]["loss"] > curve[-1]["loss"] and abs(curve[0]["loss"] - torch.log(torch.tensor(vocab)).item()) < 0.5
    assert metrics["variant_name"] == "GA(headwise)+GatedNorm(r16)"
    assert metrics["heldout"]["max_abs_residual"] > 0 and metrics["heldout"]["loss"] < curve[0]["loss"]
    assert "max |activation|" in (out / "README.md").read_text()

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.gated_norm_rank == 16 and len(tok) == model.config.vocab_size
    # the shared tokenizer is trained once; a finished checkpoint is reused, not retrained
    assert (zoo_dir / f"tokenizer-{vocab}" / "streams.pt").exists()
    stamp = (out / "metrics.json").stat().st_mtime_ns
    assert zoo.build("ga_gatednorm", zoo_dir=zoo_dir, steps=steps) == out
    assert (out / "metrics.json").stat().st_mtime_ns == stamp


def test_unknown_variant_and_size_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown zoo variant 'gated_attention'"):
        zoo.build("gated_attention", zoo_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown zoo size 'huge'"):
        zoo.build("ga", size="huge", zoo_dir=tmp_path)


def test_cli_lists_presets():
    out = subprocess.run([Path(sys.executable).parent / "quantkit", "zoo", "list"], capture_output=True, text=True, check=True)
    for name in zoo.PRESETS:
        assert name in out.stdout
