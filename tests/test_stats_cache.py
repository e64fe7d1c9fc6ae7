"""SmoothQuant's statistics cache (`quantkit.calibrate.stats_cache`): a second SmoothQuant recipe on the same source
and windows reads the first one's per-channel maxima instead of streaming the windows again, and writes the same
bytes as without the cache, on both quantization paths; the key follows what the maxima depend on; a broken or
half-written entry is never read."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.checkpoints import weight_files
from quantkit.quantize.checkpoint import quantize_checkpoint

RECIPES = {
    "fp8_sq": "scheme: fp8_block\nsmoothquant: {num_sequences: 48, seq_len: 32, early_stop: 0.5}\n",
    "nvfp4_sq": "scheme: nvfp4\nsmoothquant: {num_sequences: 48, seq_len: 32, early_stop: 0.5}\n",
    "nvfp4_sq_more": "scheme: nvfp4\nsmoothquant: {num_sequences: 56, seq_len: 32, early_stop: 0.5}\n",
    "nvfp4_sq_search": "scheme: nvfp4\nsmoothquant: "
    "{num_sequences: 48, seq_len: 32, early_stop: 0.5, search_alpha: true}\n",
}


def state_of(model_dir) -> dict[str, torch.Tensor]:
    return {k: v for f in weight_files(model_dir) for k, v in load_file(str(f)).items()}


def same_checkpoint(a, b) -> bool:
    """Equal tensors (bits) and equal SmoothQuant reports."""
    sa, sb = state_of(a), state_of(b)
    same_report = json.loads((a / "smoothquant.json").read_text()) == json.loads((b / "smoothquant.json").read_text())
    return same_report and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from quantkit.models.tiny import build_tiny_stock_checkpoint

    root = tmp_path_factory.mktemp("stats_cache")
    source = build_tiny_stock_checkpoint(root / "llama", "llama", seed=0)
    for name, text in RECIPES.items():
        (root / f"{name}.yaml").write_text(f"name: {name}\n{text}")
    uncached = {
        name: quantize_checkpoint(source, str(root / f"{name}.yaml"), root / f"plain-{name}", streaming=False)
        for name in ("fp8_sq", "nvfp4_sq")
    }
    return root, source, uncached


def entries(cache) -> list:
    return sorted(p for p in cache.iterdir() if not p.name.startswith(".")) if cache.exists() else []


def test_the_second_recipe_reads_the_first_ones_statistics_and_writes_the_same_bytes(setup):
    """FP8+SQ keeps its statistics (whole-model path); NVFP4+SQ on the same windows finds them and writes, on the
    streaming path, the bytes the uncached whole-model run wrote (the paths write the same bytes, and the cached
    maxima are the observed ones bit for bit, so every factor, fold and report is too). One entry for both, with
    the windows the early stop kept recorded per layer."""
    root, source, uncached = setup
    cache = root / "cache-a"
    fp8 = quantize_checkpoint(source, str(root / "fp8_sq.yaml"), root / "a-fp8", statistics_cache=cache)
    assert same_checkpoint(fp8, uncached["fp8_sq"])
    (entry,) = entries(cache)
    nvfp4 = quantize_checkpoint(
        source, str(root / "nvfp4_sq.yaml"), root / "a-nvfp4", streaming=True, statistics_cache=cache
    )
    assert entries(cache) == [entry]
    assert same_checkpoint(nvfp4, uncached["nvfp4_sq"])
    windows = json.loads((fp8 / "smoothquant.json").read_text())["windows_per_layer"]
    files = sorted(entry.glob("layer-*.safetensors"))
    assert len(files) == len(windows) == 2  # the tiny Llama's two decoder layers


@pytest.mark.parametrize("streaming", [False, True])
def test_the_cached_maxima_are_what_the_second_recipe_uses(setup, streaming):
    """Doubling the cached maxima of one layer changes that layer's smoothing factors (s = max|X|^a / max|W|^(1-a)),
    so the checkpoint differs from the uncached one: the second recipe read the entry instead of observing (on
    either path)."""
    root, source, uncached = setup
    cache = root / f"cache-b-{streaming}"
    quantize_checkpoint(source, str(root / "fp8_sq.yaml"), root / f"b-fp8-{streaming}", statistics_cache=cache)
    (entry,) = entries(cache)
    path = entry / "layer-1.safetensors"
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    save_file({k: 2 * v for k, v in load_file(str(path)).items()}, str(path), metadata=metadata)
    nvfp4 = quantize_checkpoint(
        source, str(root / "nvfp4_sq.yaml"), root / f"b-nvfp4-{streaming}", streaming=streaming, statistics_cache=cache
    )
    assert not same_checkpoint(nvfp4, uncached["nvfp4_sq"])


def test_other_windows_or_changed_weights_or_the_search_get_no_stale_entry(setup):
    """The key covers the windows (56 instead of 48: a second entry) and the source's weight files (rewritten: a
    third); a recipe that searches alpha neither reads nor writes an entry (its search needs the sampled rows)."""
    root, source, _ = setup
    cache = root / "cache-c"
    quantize_checkpoint(source, str(root / "nvfp4_sq.yaml"), root / "c-1", statistics_cache=cache)
    quantize_checkpoint(source, str(root / "nvfp4_sq_more.yaml"), root / "c-2", statistics_cache=cache)
    assert len(entries(cache)) == 2
    quantize_checkpoint(source, str(root / "nvfp4_sq_search.yaml"), root / "c-3", statistics_cache=cache)
    assert len(entries(cache)) == 2
    copy = root / "llama-copy"
    copy.mkdir()
    for f in source.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    weights = weight_files(copy)[0]
    state = load_file(str(weights))
    save_file(state, str(weights), metadata={"format": "pt"})  # same tensors, a new file: a new key
    quantize_checkpoint(copy, str(root / "nvfp4_sq.yaml"), root / "c-4", statistics_cache=cache)
    assert len(entries(cache)) == 3


def test_a_broken_entry_is_recomputed_and_a_failed_calibration_leaves_none(setup, monkeypatch, caplog):
    """A truncated layer file is reported and the statistics are observed again (the bytes of the uncached run);
    a calibration that fails part-way leaves neither an entry nor its temporary directory."""
    import quantkit.calibrate.smoothquant as smoothquant

    root, source, uncached = setup
    cache = root / "cache-d"
    quantize_checkpoint(source, str(root / "nvfp4_sq.yaml"), root / "d-1", statistics_cache=cache)
    (entry,) = entries(cache)
    (entry / "layer-0.safetensors").write_bytes(b"\x10\x00")
    caplog.set_level("WARNING", logger="quantkit.calibrate.stats_cache")
    again = quantize_checkpoint(source, str(root / "nvfp4_sq.yaml"), root / "d-2", statistics_cache=cache)
    assert "unreadable" in caplog.text
    assert same_checkpoint(again, uncached["nvfp4_sq"])

    failing = root / "cache-e"
    real = smoothquant.layer_factors

    def fail_at_layer_1(model, layer, i, *args, **kwargs):
        if i == 1:
            raise RuntimeError("killed")
        return real(model, layer, i, *args, **kwargs)

    monkeypatch.setattr(smoothquant, "layer_factors", fail_at_layer_1)
    with pytest.raises(RuntimeError, match="killed"):
        quantize_checkpoint(source, str(root / "nvfp4_sq.yaml"), root / "e", streaming=False, statistics_cache=failing)
    assert not failing.exists() or not any(failing.iterdir())


def test_a_studys_smoothquant_rows_of_one_model_share_one_calibration(tmp_path):
    """A study quantizes each (model, recipe) with the statistics cache in its run directory: its W8A8+SQ and
    W4A4+SQ rows of one model leave one entry (the second row read the first one's maxima)."""
    from quantkit.models.tiny import build_tiny_stock_checkpoint
    from quantkit.pipelines.study import Study, StudySpec

    source = build_tiny_stock_checkpoint(tmp_path / "llama", "llama", seed=0)
    spec = StudySpec(
        name="t",
        models={"a": str(source)},
        recipes=["bf16", "w8a8_fp8_block_sq", "w4a4_nvfp4_sq"],
        calibration={"num_sequences": 40, "seq_len": 32},
    )
    study = Study(spec, tmp_path / "run")
    for recipe in ("w8a8_fp8_block_sq", "w4a4_nvfp4_sq"):
        study._quantize("a", recipe)
    assert len(entries(tmp_path / "run" / "cache" / "smoothquant")) == 1
