"""Formats per module under a bit budget (quantkit.diagnose.budget, issue 51 item 4): the stored bits it counts,
the knapsack it solves, and `quantkit quantize --avg-bits` / the recipe key end to end on the tiny model."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from safetensors import safe_open

from quantkit.cli import main
from quantkit.diagnose.budget import GRANULES, BudgetError, Unit, choose_schemes, resolve_bit_budget, weight_bits
from quantkit.formats.constants import WeightScales
from quantkit.formats.schemes import SCHEMES
from quantkit.quantize.checkpoint import quantize_checkpoint
from quantkit.quantize.plan import served_unit
from quantkit.quantize.recipe import load_recipe, parse_recipe, with_bit_budget

SCHEME_ORDER = ("nvfp4", "fp8_block", "bf16")


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("shape", [(200, 72), (128, 896), (33, 17), (1, 16)])
def test_stored_bits_are_what_encode_writes(scheme, shape):
    """`Scheme.stored_bits` is the bit count of the tensors `encode` writes (codes and every decode scale), exactly."""
    tensors = SCHEMES[scheme].encode(torch.randn(shape, generator=torch.Generator().manual_seed(0)), "w")
    assert SCHEMES[scheme].stored_bits(*shape) == sum(8 * t.numel() * t.element_size() for t in tensors.values())


def test_served_units_follow_vllm_fusion():
    assert served_unit("model.layers.3.self_attn.k_proj") == "model.layers.3.self_attn.q_proj+k_proj+v_proj"
    assert served_unit("model.layers.3.mlp.up_proj") == "model.layers.3.mlp.gate_proj+up_proj"
    assert served_unit("model.layers.3.mlp.down_proj") == "model.layers.3.mlp.down_proj"
    assert served_unit("model.layers.3.mlp.experts.17.down_proj") == "model.layers.3.mlp.experts"
    assert served_unit("model.layers.3.linear_attn.in_proj_qkvz") == "model.layers.3.linear_attn.in_proj_qkvz"


def _units(seed: int, count: int) -> list[Unit]:
    """`count` units of random shapes and random NSRs decreasing with precision (bf16: 0), as measured ones are."""
    g = torch.Generator().manual_seed(seed)
    units = []
    for i in range(count):
        n, k = (int(v) * 16 for v in torch.randint(1, 40, (2,), generator=g))
        low = float(torch.rand((), generator=g)) * 0.05
        nsr = {"nvfp4": low, "fp8_block": low * float(torch.rand((), generator=g)) * 0.2, "bf16": 0.0}
        units.append(Unit(f"u{i}", (f"u{i}",), n * k, nsr, {s: weight_bits(s, n, k) for s in SCHEME_ORDER}))
    return units


def _brute_force(units: list[Unit], max_bits: float) -> float:
    """The least summed NSR over every assignment storing at most `max_bits` bits (inf when none does)."""
    best = float("inf")
    for pick in itertools.product(SCHEME_ORDER, repeat=len(units)):
        if sum(u.bits[s] for u, s in zip(units, pick)) <= max_bits:
            best = min(best, sum(u.nsr[s] for u, s in zip(units, pick)))
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("avg_bits", [4.6, 5.5, 8.0, 11.0])
def test_choice_is_the_knapsack_optimum_within_one_step_a_unit(seed, avg_bits):
    """Against every assignment of 6 units (3^6): the chosen map stores at most avg_bits x elements bits, and its
    summed NSR is no worse than the best assignment within that budget less one DP step per unit (each unit's extra
    cost is rounded up to whole steps of room / GRANULES, so any assignment that fits the smaller budget fits the
    DP). The sums are of 6 float64 terms, exact to ~1e-15 relative: compared with a 1e-12 relative margin."""
    units = _units(seed, 6)
    elements = sum(u.elements for u in units)
    lowest = sum(u.bits["nvfp4"] for u in units)
    budget = avg_bits * elements
    choice = choose_schemes(units, SCHEME_ORDER, avg_bits)
    assert sum(u.bits[choice[u.name]] for u in units) <= budget
    achieved = sum(u.nsr[choice[u.name]] for u in units)
    step = (budget - lowest) / GRANULES
    assert _brute_force(units, budget) <= achieved * (1 + 1e-12)
    assert achieved <= _brute_force(units, budget - len(units) * step) * (1 + 1e-12)


def test_a_budget_below_the_lowest_scheme_is_refused():
    units = _units(0, 3)
    with pytest.raises(BudgetError, match="below the lowest"):
        choose_schemes(units, SCHEME_ORDER, 4.4)


NVFP4 = {"name": "x", "scheme": "nvfp4"}


@pytest.mark.parametrize(
    "data, message",
    [
        ({**NVFP4, "bit_budget": {}}, "needs avg_bits"),
        ({**NVFP4, "bit_budget": {"avg_bits": 17}}, "between 0 and 16"),
        ({**NVFP4, "bit_budget": {"avg_bits": "five"}}, "must be a number"),
        ({**NVFP4, "bit_budget": {"avg_bits": 6, "seq_len": 0}}, "positive integer"),
        ({"name": "x", "scheme": "bf16", "bit_budget": {"avg_bits": 6}}, "quantized schemes"),
        (
            {"name": "x", "scheme": "NVFP4", "backend": "llmcompressor", "bit_budget": {"avg_bits": 6}},
            "quantized schemes",
        ),
        ({**NVFP4, "module_schemes": [{"re:.*": "fp8_block"}], "bit_budget": {"avg_bits": 6}}, "drop module_schemes"),
        ({**NVFP4, "rotation": {}, "bit_budget": {"avg_bits": 6}}, "rotation"),
    ],
)
def test_bad_budgets_are_named(data, message):
    with pytest.raises(ValueError, match=message):
        parse_recipe(data)


@pytest.fixture(scope="module")
def budget_recipe(tmp_path_factory):
    """w4a4_nvfp4 with a budget of 6 bits a weight, its sensitivities on 2 x 64 held-out tokens (test-sized)."""
    path = tmp_path_factory.mktemp("recipes") / "w4a4_nvfp4_budget6.yaml"
    path.write_text(
        "name: w4a4_nvfp4_budget6\nscheme: nvfp4\nactivation_scale: per_token\n"
        "bit_budget: {avg_bits: 6.0, num_sequences: 2, seq_len: 64}\n"
    )
    return path


def test_cli_chooses_records_and_stores_the_budget(tiny_checkpoint, budget_recipe, tmp_path, capsys):
    """`quantkit quantize` with a budget recipe: the map printed, recorded in quantization_config.bit_budget and
    written as module_schemes; fused layers in one scheme; the checkpoint's quantized weights store exactly the bits
    the record says (the tiny model's source is float32, so the check needs no layer kept unquantized: at 6 bits
    none is), at most the budget."""
    out = tmp_path / "q"
    assert main(["quantize", str(tiny_checkpoint), str(budget_recipe), str(out)]) == 0
    assert "bit budget: 6 bits a weight asked" in capsys.readouterr().out
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    record = qc["bit_budget"]
    units = record["units"]
    assert {u["scheme"] for u in units.values()} <= {"nvfp4", "fp8_block"}
    assert record["achieved_avg_bits"] <= 6.0
    for name in qc["quantized_modules"]:
        assert qc["module_schemes"].get(name, "nvfp4") == units[served_unit(name)]["scheme"]
    stored, elements = 0, 0
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for key in f.keys():
            if key.rpartition(".")[0] in qc["quantized_modules"] and not key.endswith("input_global_scale"):
                t = f.get_tensor(key)
                stored += 8 * t.numel() * t.element_size()
    with safe_open(str(tiny_checkpoint / "model.safetensors"), "pt") as f:
        for name in qc["quantized_modules"]:
            elements += math.prod(f.get_slice(f"{name}.weight").get_shape())
    assert (stored, elements) == (record["stored_bits"], record["elements"])
    assert stored <= 6.0 * elements


def test_both_quantize_paths_write_the_same_bytes(tiny_checkpoint, budget_recipe, tmp_path):
    """The choice is made once, before either path: streaming and whole-model write the same tensors."""
    recipe = resolve_bit_budget(tiny_checkpoint, load_recipe(budget_recipe), progress=False)
    whole = quantize_checkpoint(tiny_checkpoint, recipe, tmp_path / "whole", streaming=False)
    streamed = quantize_checkpoint(tiny_checkpoint, recipe, tmp_path / "streamed", streaming=True)
    tensors = {}
    for path in (whole, streamed):
        with open(path / "config.json") as f:
            assert json.load(f)["quantization_config"]["bit_budget"] == recipe.bit_budget_choice
        files = sorted(path.glob("*.safetensors"))
        tensors[path] = {}
        for file in files:
            with safe_open(str(file), "pt") as f:
                tensors[path].update({k: f.get_tensor(k) for k in f.keys()})
    assert tensors[whole].keys() == tensors[streamed].keys()
    assert all(
        torch.equal(tensors[whole][k].view(torch.uint8), tensors[streamed][k].view(torch.uint8)) for k in tensors[whole]
    )


@pytest.mark.parametrize(
    "recipe, bits, message",
    [
        ("w4a4_nvfp4", "3", "at least 4.5"),
        ("mixed_fp8_attn_nvfp4", "6", "drop module_schemes"),
        ("bf16", "6", "quantized schemes"),
    ],
)
def test_cli_refuses_bad_budgets_with_exit_2(tiny_checkpoint, tmp_path, capsys, recipe, bits, message):
    argv = ["quantize", str(tiny_checkpoint), recipe, str(tmp_path / recipe), "--avg-bits", bits]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / recipe).exists()


def test_an_unresolved_budget_is_refused_by_quantize_checkpoint(tiny_checkpoint, tmp_path):
    recipe = with_bit_budget(load_recipe("w4a4_nvfp4"), 6.0)
    assert recipe.weight_scales == WeightScales.MINMAX
    with pytest.raises(ValueError, match="resolve_bit_budget"):
        quantize_checkpoint(tiny_checkpoint, recipe, tmp_path / "q")
