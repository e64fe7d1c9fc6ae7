"""Checkpoints before and after a refactor: quantize a fixed set of (source, recipe, path) with whichever quantkit is
first on sys.path, hash every file, and compare two such runs.

    PYTHONPATH=<old worktree> python benchmarks/checkpoint_bytes.py run OLD_DIR
    python benchmarks/checkpoint_bytes.py run NEW_DIR --sources OLD_DIR/src
    python benchmarks/checkpoint_bytes.py compare OLD_DIR NEW_DIR

Sources: the tiny dense model with every rescaling feature, the tiny hybrid MoE, and SmolLM2-135M-Instruct (a
trained model; `quantkit models fetch smollm2-135m-instruct` first). Every recipe at 4 x 32 calibration windows, by
the whole-model and the streaming path, one torch thread (the float32 sums in one order). `compare` reports each
checkpoint as byte-identical, identical but for the order of a .safetensors header's `__metadata__` keys, or a
problem (a tensor, a header entry or another file differs; an error in one run only).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
import time
from pathlib import Path

DENSE = ["bf16", "w8a8_fp8_block", "w8a8_fp8_block_mse", "w4a4_nvfp4", "w4a4_nvfp4_static", "w4a4_nvfp4_sq",
         "w4a4_nvfp4_sq_updown", "w4a4_nvfp4_gptq", "w4a4_nvfp4_mse", "w4a4_nvfp4_rot", "w4a4_nvfp4_rot16_gptq_mse",
         "w4a4_nvfp4_had16_gptq_mse", "w4a4_nvfp4_awq", "w4a4_nvfp4_46", "mixed_fp8_attn_nvfp4", "w8a8_fp8_block_sq",
         "w4a4_nvfp4_sq_gptq_actorder"]  # fmt: skip
TRAINED = ["bf16", "w4a4_nvfp4", "w4a4_nvfp4_static", "w4a4_nvfp4_sq", "w4a4_nvfp4_gptq", "w4a4_nvfp4_had16_gptq_mse",
           "w4a4_nvfp4_awq", "mixed_fp8_attn_nvfp4", "w4a4_nvfp4_rot"]  # fmt: skip


def run(out: Path, sources_dir: Path | None) -> None:
    import torch

    import quantkit
    from quantkit.models.tiny import build_tiny_checkpoint
    from quantkit.models.tiny_hybrid import build_tiny_hybrid_checkpoint
    from quantkit.models.trained import cached
    from quantkit.quantize.checkpoint import quantize_checkpoint
    from quantkit.quantize.provenance import with_calibration
    from quantkit.quantize.recipe import load_recipe

    torch.set_num_threads(1)
    print(f"quantkit from {quantkit.__file__}", flush=True)
    src = sources_dir or out / "src"
    if not (src / "dense").exists():
        build_tiny_checkpoint(src / "dense", attn_output_gate="headwise", gated_norm_rank=16, attention_sink=True)
        build_tiny_hybrid_checkpoint(src / "hybrid")
    trained = cached("smollm2-135m-instruct")
    if trained is None:
        sys.exit("smollm2-135m-instruct is not cached: run `quantkit models fetch smollm2-135m-instruct`")
    sources = {"dense": src / "dense", "hybrid": src / "hybrid", "smollm2": trained}
    jobs = [(s, r) for s in ("dense", "hybrid") for r in DENSE] + [("smollm2", r) for r in TRAINED]
    hashes: dict[str, dict[str, str]] = {}
    for n, (source, recipe) in enumerate(jobs):
        for streaming in (False, True):
            key = f"{source}/{recipe}/{'stream' if streaming else 'whole'}"
            target, start = out / "out" / key, time.time()
            try:
                r = with_calibration(load_recipe(recipe), 4, 32)
                quantize_checkpoint(sources[source], r, target, overwrite=True, streaming=streaming)
                hashes[key] = {
                    p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(target.iterdir()) if p.is_file()
                }
            except Exception as err:  # recorded: the other run must fail the same way
                hashes[key] = {"error": f"{type(err).__name__}: {err}"[:300]}
            print(f"[{n + 1}/{len(jobs)}] {key} {time.time() - start:.1f} s {hashes[key].get('error', '')}", flush=True)
    (out / "hashes.json").write_text(json.dumps(hashes, indent=1, sort_keys=True))


def _split(path: Path) -> tuple[dict, dict | None, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    return header, header.pop("__metadata__", None), raw[8 + n :]


def compare(a: Path, b: Path) -> int:
    before, after = (json.loads((d / "hashes.json").read_text()) for d in (a, b))
    if set(before) != set(after):
        print(f"the runs quantized different sets: {sorted(set(before) ^ set(after))}")
        return 1
    identical = metadata_order = 0
    problems = []
    for key in sorted(before):
        x, y = before[key], after[key]
        if "error" in x or "error" in y:
            problems += [] if x == y else [f"{key}: {x.get('error')} | {y.get('error')}"]
            continue
        if x == y:
            identical += 1
            continue
        bad = [f for f in sorted(set(x) | set(y)) if x.get(f) != y.get(f)]
        if all(f.endswith(".safetensors") and _split(a / "out" / key / f) == _split(b / "out" / key / f) for f in bad):
            metadata_order += 1
        else:
            problems.append(f"{key}: {bad}")
    errors = sum("error" in h for h in before.values())
    print(
        f"{len(before)} checkpoints: {identical} byte-identical, {metadata_order} identical but for the order of a "
        f"header's __metadata__ keys, {errors} refused alike in both runs, {len(problems)} problems"
    )
    print("\n".join(problems))
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--sources", type=Path, default=None, help="the tiny sources of an earlier run (same bytes)")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run(args.out, args.sources)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
