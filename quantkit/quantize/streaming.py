"""Streaming quantization: one decoder layer in memory at a time, the same tensors as the whole-model path.

`quantize_checkpoint(..., streaming=True)` (`quantkit quantize --streaming`) lands here. The whole-model path
(`quantkit.quantize.checkpoint`) loads every parameter in float32, keeps a second copy as the state it writes, and
runs calibration through the whole model: ~8 bytes a parameter (a 24.6B model: ~200 GB). Here:

1. The model is built on the meta device (`skeleton`: structure and names, no data); the parameters outside the
   decoder layers (embeddings, final norm, lm_head) are written first, one module at a time.
2. Without forward passes (recipes with neither SmoothQuant nor static activation scales) each layer's tensors
   are read (`quantkit.checkpoints.TensorReader`, one tensor at a time, plain reads), encoded and written.
3. With SmoothQuant and/or static scales, the calibration windows are embedded by the skeleton's own forward, with
   each decoder layer's `forward` replaced by a recorder that keeps the keyword arguments the model passes it
   (position embeddings, the mask of its layer type) and stops after the last layer. Then, layer by layer:
   the layer is materialized from the checkpoint in float32 (and, for rotation recipes, rotated: see 4.); the
   hidden states of each calibration stream go through it (in memory, or spilled to files with torch.save when a
   stream is larger than `spill_bytes`):
     - `sq`: the SmoothQuant windows through the UNSMOOTHED layer, with the statistics hooks of
       `quantkit.calibrate.stats` on the layer's consumers (the whole-model path also calibrates unsmoothed);
     - `ref`: the verification windows (the first 4) through the unsmoothed layer;
     then the layer's factors are computed and folded (`quantkit.calibrate.smoothquant`'s functions), and
     - `smoothed`: the verification windows through the FOLDED layer;
     - `gptq`: GPTQ's windows through the folded layer, their Hessians first (`quantkit.quantize.gptq.gptq_layer`:
       the layer's weights become GPTQ's), then through the GPTQ'd layer, as the whole-model path orders them;
     - `static`: the static-scale windows through the folded (or, without SmoothQuant, the plain) layer with the
       hooks on its quantized matrices (all-experts mode for routed experts, as the whole-model path);
   the layer's tensors are encoded and written, and the layer goes back to the meta device.
   At the end the skeleton's forward (layers replaced by the carried hidden states) gives the logits of `ref`
   and `smoothed`: the function-preservation check of `smooth_model`, same tolerance, same error.
4. Rotation (`quantkit.quantize.rotation`, checked on the skeleton before anything is read): the parameters
   outside the layers are loaded, the check windows embedded unrotated (stream `unrotated`), then embeddings,
   final norm and lm_head rotated in memory (kept there for the checks) and written; each layer is rotated right
   after it is materialized (an input rotation, `residual` False: after SmoothQuant's fold, as in the whole-model
   path), `unrotated` passing it before and `rotated` after. At the end the rotated head's
   logits of `rotated` must match those of `unrotated` times Q (`verify_rotation`).

Same bytes: every layer runs the same float32 operations on the same batches (batch size 8, as `smooth_model` and
`channel_max`) with the same arguments as inside the whole model, so the statistics, factors, folds, encodings
and the SmoothQuant report are bit-identical on CPU (tests/test_streaming_quantize.py asserts it for every recipe,
dense and hybrid MoE). Output: `model-0000i-of-0000n.safetensors` shards of at most `max_shard_bytes` (a
tensor is never split) and `model.safetensors.index.json`, written atomically like the whole-model checkpoint;
config.json, tokenizer and smoothquant.json are the same files.

Peak memory: the largest of (a) one non-layer module in float32 and its written form, (b) the input embeddings in
float32 while the calibration windows are embedded (then released: `_embed` runs before the first layer), (c) one
decoder layer in float32 (plus its encoded tensors) and the calibration hidden states of the streams (N x T x hidden
x 4 bytes each, twice while a layer runs; one batch when spilled), (d) the lm_head in float32 and HEAD_POSITIONS
positions of logits for the function-preservation check (`quantkit.calibrate.layers`); with rotation, the float32
embeddings and lm_head for the whole run and a float64 copy of one while it is rotated: independent of depth
(benchmarks/bench_quantize_memory.py; benchmarks/bench_trained.py on the trained models).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from io import BufferedWriter
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

import quantkit.models  # noqa: F401  (registers quantkit's model types)
from quantkit.atomic import atomic_dir
from quantkit.calibrate.alpha_search import AlphaSearch
from quantkit.calibrate.layers import (
    LayerwiseError,
    Stream,
    advance_stream,
    decoder_stack,
    embed_stream,
    load_outside,
    materialize,
    open_source,
    outside_keys,
    outside_state,
    pin_mmap_threshold,
    skeleton_model,
    source_tensors,
    tied_partners,
)
from quantkit.calibrate.mappings import MappingPlan, SmoothMapping, resolve_mappings
from quantkit.calibrate.smoothquant import (
    BATCH_SIZE,
    DEFAULT_TOLERANCE,
    DEFAULT_VERIFY_SEQUENCES,
    LayerFactors,
    SmoothQuantReport,
    check_preserved,
    fold_layer,
    layer_factors,
    layer_mappings,
    logit_change,
    smoothquant_report,
    statistics_entry,
)
from quantkit.calibrate.stats import ChannelMaxObserver
from quantkit.calibrate.stats_cache import CacheLocation, LayerStatistics, StatisticsCache, reuse_or_record
from quantkit.checkpoints import SAFETENSORS_DTYPES, tensor_headers
from quantkit.formats.hadamard import residual_rotation
from quantkit.quantize import output
from quantkit.quantize.gptq import gptq_layer
from quantkit.quantize.plan import QuantPlan, RotationStep, SmoothQuantStep
from quantkit.quantize.recipe import Recipe, SmoothQuantSettings
from quantkit.quantize.rotation import (
    RotationPlan,
    RotationReport,
    check_online_quantized,
    check_rotation_preserved,
    plan_rotation,
    rotate_layer,
    rotate_outside,
    search_through_online,
)

logger = logging.getLogger(__name__)

DEFAULT_SPILL_BYTES = 256 * 2**20  # a stream's hidden states above this go to disk, one file a batch
DEFAULT_MAX_SHARD_BYTES = 2 * 2**30
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


class StreamingError(LayerwiseError):
    """The model's structure does not allow layer-by-layer quantization (the message says what and why)."""


# --------------------------------------------------------------------------------------------- output shards


class ShardWriter:
    """safetensors shards written as tensors arrive: each tensor's bytes go to a data file at once, the header
    (which must precede the data) is written when the shard closes, then the data is copied behind it: memory is
    one tensor, whatever the shard size. `finish()` names the shards model-0000i-of-0000n.safetensors and writes
    model.safetensors.index.json."""

    def __init__(self, out_dir: Path, max_shard_bytes: int, metadata: dict[str, str]) -> None:
        self.out_dir, self.max_shard_bytes, self.metadata = out_dir, max_shard_bytes, metadata
        self.shards: list[tuple[Path, list[str]]] = []  # closed shards and their tensors
        self.total_size = 0
        self._data: BufferedWriter | None = None
        self._entries: dict[str, dict] = {}
        self._offset = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append `tensor` (any device; stored contiguous on CPU, its own dtype) under `name`, closing the shard
        first when this tensor would take it past max_shard_bytes."""
        t = tensor.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if self._entries and self._offset + nbytes > self.max_shard_bytes:
            self._close_shard()
        if self._data is None:
            self._data = open(self.out_dir / f".shard-{len(self.shards)}.data", "wb")
        if t.dtype not in _DTYPE_NAMES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors name")
        if nbytes:
            # numpy's stubs give ndarray __buffer__ only for Python >= 3.12; it exports the buffer protocol on 3.11 too
            self._data.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
        self._entries[name] = {
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [self._offset, self._offset + nbytes],
        }
        self._offset += nbytes
        self.total_size += nbytes

    def _close_shard(self) -> None:
        data_file = cast(BufferedWriter, self._data)  # open: add() opened it, and the shard has entries
        data_path = Path(data_file.name)
        data_file.close()
        header = json.dumps({"__metadata__": self.metadata, **self._entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned (safetensors' own padding)
        shard = self.out_dir / f".shard-{len(self.shards)}.safetensors"
        with open(shard, "wb") as out, open(data_path, "rb") as data:
            out.write(struct.pack("<Q", len(header)) + header)
            shutil.copyfileobj(data, out, 16 * 2**20)
        data_path.unlink()
        self.shards.append((shard, list(self._entries)))
        self._data, self._entries, self._offset = None, {}, 0

    def finish(self) -> dict:
        """Close the last shard, name the shards, write the index; returns the index."""
        if self._data is not None:
            self._close_shard()
        n = len(self.shards)
        weight_map = {}
        for i, (path, names) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {
            "metadata": {"total_size": self.total_size, **self.metadata},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return index


# --------------------------------------------------------------------------------------------- the path


def quantize_streaming(
    model_dir: str | Path,
    recipe: Recipe | QuantPlan,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    spill_bytes: int = DEFAULT_SPILL_BYTES,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    statistics_cache: CacheLocation | None = None,
) -> Path:
    """Quantize `model_dir` with `recipe` (or its plan, `quantkit.quantize.plan`, resolved on this model) one decoder
    layer at a time (module docstring); write `out_dir` atomically.

    spill_bytes: a calibration stream whose hidden states (N x T x hidden x 4 bytes) exceed this is kept on disk;
    max_shard_bytes: the output shard size; statistics_cache: SmoothQuant's statistics reused from / kept there
    (`quantkit.calibrate.stats_cache`). Raises what the whole-model path raises (CheckpointError,
    SmoothQuantMappingError, NonFiniteStatisticsError, FunctionPreservationError), and StreamingError."""
    pin_mmap_threshold()
    job = _StreamingJob.resolve(Path(model_dir), recipe)
    out_dir = Path(out_dir)
    metadata = output.SAFETENSORS_METADATA
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # named like atomic_dir's temporaries: a SIGKILLed run's hidden states are removed by the next writer of out_dir
    spill_root = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{os.getpid()}.", suffix=".tmp", dir=out_dir.parent))
    try:
        with atomic_dir(out_dir, overwrite=overwrite) as tmp:
            writer = ShardWriter(tmp, max_shard_bytes, metadata)
            tied = tied_partners(job.skeleton)
            # the forward up to the first layer needs all but the head; the head is loaded again for the check
            before_head, head_keys = outside_keys(job.skeleton)
            unrotated = None
            if job.rotation is not None:  # outside rotated in memory (the head kept for the check), then written
                load_outside(job.skeleton, job.reader, before_head + head_keys, tied)
                unrotated = embed_stream(job.skeleton, job.layers, "unrotated", job.tokens["rotation check"], None)
                if job.rotation.residual:
                    rotate_outside(job.skeleton, job.rotation, job.rotation_q)
                    job.config.tie_word_embeddings = False
                    job.write_outside(writer, tied, loaded=True)
                else:  # no residual Q: nothing outside the layers changes (a tied head stays tied)
                    job.write_outside(writer, tied)
            else:
                job.write_outside(writer, tied)
                if job.tokens:
                    load_outside(job.skeleton, job.reader, before_head, tied)
            calibrated: list[LayerFactors] = []
            with reuse_or_record(job.statistics_entry(statistics_cache), len(job.layers)) as (cached, recorder):
                streams = job.open_streams(spill_root, spill_bytes, observe=cached is None)
                if unrotated is not None:
                    streams["unrotated"] = unrotated
                    check = job.tokens["rotation check"]
                    streams["rotated"] = embed_stream(job.skeleton, job.layers, "rotated", check, None)
                desc = f"quantize {job.plan.name} (streaming{', cached statistics' if cached else ''})"
                for i in tqdm(range(len(job.layers)), desc=desc, unit="layer"):
                    job.quantize_layer(i, streams, writer, calibrated, None if cached is None else cached[i])
                    if recorder is not None:
                        recorder.save(i, calibrated[-1].statistics)
            rotation = None if job.rotation is None else job.verify_rotation(streams["unrotated"], streams["rotated"])
            report = None
            if (sq := job.plan.smoothquant) is not None:
                if job.rotation is None:  # a rotated head is in memory already
                    load_outside(job.skeleton, job.reader, head_keys, tied)
                report = _verify(
                    job.skeleton,
                    job.layers,
                    streams["ref"],
                    streams["smoothed"],
                    cast(MappingPlan, job.mappings),  # set with sq
                    sq,
                    job.tokens["smoothquant"],
                    calibrated,
                )
            writer.finish()
            config_out = output.output_config(job.config, type(job.skeleton).__name__, job.plan)
            if rotation is not None:
                config_out["quantization_config"]["rotation"] = rotation.to_dict()
            output.write_side_files(tmp, config_out, job.tokenizer, report, model_dir)
    finally:
        shutil.rmtree(spill_root, ignore_errors=True)
    return out_dir


@dataclass
class _StreamingJob:
    """What `quantize_streaming` works from, resolved before any weight is read: the quantization `plan`
    (`quantkit.quantize.plan`), the model on the meta device (`skeleton`, its decoder `layers` under `stack_name`),
    the quantized matrices outside the decoder layers (`outside`), the SmoothQuant mappings (`mappings`,
    `per_layer`), each calibration set's (N, T) int64 windows by use (`tokens`: the plan's "smoothquant", "gptq",
    "activation scales", "rotation check"), and for rotation recipes the rotation's plan on the skeleton
    (`rotation`) and the residual rotation `rotation_q`."""

    model_dir: Path
    plan: QuantPlan
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    reader: Any
    skeleton: PreTrainedModel
    stack_name: str
    layers: nn.ModuleList
    outside: list[str]
    mappings: MappingPlan | None
    per_layer: list[tuple[SmoothMapping, ...]] | None
    tokens: dict[str, torch.Tensor]
    source_headers: dict[str, tuple[str, tuple[int, ...]]]
    smoothed: list[str]
    rotation: RotationPlan | None
    rotation_q: torch.Tensor
    search: AlphaSearch | None  # SmoothQuant's search (the plan's; through an input rotation's transforms)

    @classmethod
    def resolve(cls, model_dir: Path, recipe: Recipe | QuantPlan) -> _StreamingJob:
        """Read config, tokenizer and tensor headers; resolve the plan (unless given); refuse what streaming cannot
        do (StreamingError)."""
        config = AutoConfig.from_pretrained(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        reader = open_source(model_dir, config.model_type)  # under the model's names (e.g. Mixtral's hub layout)
        skeleton = skeleton_model(config)
        try:
            stack_name, layers = decoder_stack(skeleton)
        except LayerwiseError as err:
            raise StreamingError(f"{err}; use the whole-model path (--no-streaming)") from err
        if isinstance(recipe, QuantPlan):
            plan = recipe
        else:  # meta tensors: names only
            plan = QuantPlan.resolve(recipe, config, list(output.quantizable_weights(skeleton)))
        outside = [n for n in plan.quantized if not n.startswith(f"{stack_name}.")]
        if outside and plan.static_scales is not None:
            raise StreamingError(
                f"static activation scales for matrices outside the decoder layers ({outside[:3]}) are "
                "not calibrated by the streaming path; use the whole-model path (--no-streaming)"
            )
        sq = plan.smoothquant
        mappings = resolve_mappings(skeleton, **sq.settings.mapping_flags()) if sq is not None else None
        per_layer = layer_mappings(mappings, stack_name, len(layers)) if mappings is not None else None
        windows = [*plan.calibration_windows, *([plan.rotation.check] if plan.rotation is not None else [])]
        rotation, rotation_q = None, torch.empty(0)
        if plan.rotation is not None:  # checked on the skeleton: a refusal before anything is read or written
            settings = plan.rotation.settings
            rotation = plan_rotation(
                skeleton, settings.online, settings.down_block, settings.residual, plan.quantized, settings.online_o
            )
            check_online_quantized(plan.name, rotation.online_hadamard, plan.quantized)
            if settings.residual:  # else no Q: rotate_outside leaves the outside as it is
                rotation_q = residual_rotation(config.hidden_size, settings.seed, settings.block)
        search = None if sq is None else sq.search
        if search is not None and rotation is not None and cast(RotationStep, plan.rotation).settings.after_smoothing:
            search = search_through_online(search, rotation.online_hadamard)
        return cls(
            model_dir=model_dir,
            plan=plan,
            config=config,
            tokenizer=tokenizer,
            reader=reader,
            skeleton=skeleton,
            stack_name=stack_name,
            layers=layers,
            outside=outside,
            mappings=mappings,
            per_layer=per_layer,
            tokens={w.use: w.tokens(tokenizer) for w in windows},
            source_headers=tensor_headers(model_dir),
            smoothed=[] if mappings is None else [m.smooth for m in mappings.mappings],
            rotation=rotation,
            rotation_q=rotation_q,
            search=search,
        )

    @property
    def sq(self) -> SmoothQuantSettings | None:
        """The plan's SmoothQuant settings (None: no SmoothQuant)."""
        return None if self.plan.smoothquant is None else self.plan.smoothquant.settings

    def finish_state(
        self,
        state: dict[str, torch.Tensor],
        matrices: dict[str, torch.Tensor],
        amax: dict[str, torch.Tensor],
        scales: dict[str, dict[str, torch.Tensor]] | None = None,
    ) -> dict[str, torch.Tensor]:
        """A module's checkpoint tensors: `matrices` encoded with the scheme (`amax`: their static input amax;
        `scales`: GPTQ's decode scales by matrix), the rest in the source dtype (bf16 for the bf16 recipe)."""
        if self.plan.scheme is None:
            return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
        norm_keys = output.smoothed_norm_keys(self.smoothed, state)
        output.unquantized_to_source_dtype(state, list(matrices), self.source_headers, self.config, norm_keys)
        output.encode_matrices(state, matrices, self.plan, amax, desc="", progress=False, scales=scales)
        return state

    def write_outside(self, writer: ShardWriter, tied: dict[str, str], loaded: bool = False) -> None:
        """The parameters outside the decoder layers, written one module at a time: read from the checkpoint, or
        (`loaded`) the skeleton's own, already in memory (a rotation changed them)."""
        owners: dict[str, list[str]] = {}
        current = self.skeleton.state_dict(keep_vars=True)
        for key in current:
            if not key.startswith(f"{self.stack_name}."):
                owners.setdefault(key.rpartition(".")[0], []).append(key)
        for keys in owners.values():
            if loaded:
                state = {k: current[k].detach().clone() for k in keys}
            else:
                state = outside_state(self.reader, keys, tied, self.model_dir)
            matrices = {n: state[f"{n}.weight"] for n in self.outside if f"{n}.weight" in state}
            for key, tensor in self.finish_state(state, matrices, {}).items():
                writer.add(key, tensor)
            del state, matrices

    def statistics_entry(self, location: CacheLocation | None) -> StatisticsCache | None:
        """SmoothQuant's statistics cache entry for this job (`smoothquant.statistics_entry`), None without one."""
        step = self.plan.smoothquant
        if step is None or self.per_layer is None:
            return None
        tokens, early_stop = self.tokens["smoothquant"], step.settings.early_stop_rule()
        return statistics_entry(location, tokens, self.per_layer, early_stop, BATCH_SIZE, step.search)

    def open_streams(self, spill_root: Path, spill_bytes: int, observe: bool = True) -> dict[str, Stream]:
        """The calibration streams: "sq" (SmoothQuant's statistics; not with `observe` False: cached ones), "ref"
        and "smoothed" (the function check's unsmoothed and smoothed passes over the first DEFAULT_VERIFY_SEQUENCES
        windows), "gptq" (GPTQ's Hessians), "static" (static activation scales); a stream above `spill_bytes` of
        hidden states lives under `spill_root`."""
        streams: dict[str, Stream] = {}
        spill: dict[str, Path | None] = {}
        sq_tokens = self.tokens.get("smoothquant")
        ref_tokens = None if sq_tokens is None else sq_tokens[:DEFAULT_VERIFY_SEQUENCES]
        for name, tokens in (
            ("sq", sq_tokens if observe else None),
            ("ref", ref_tokens),
            ("gptq", self.tokens.get("gptq")),
            ("static", self.tokens.get("activation scales")),
        ):
            if tokens is None:
                continue
            big = tokens.numel() * self.config.hidden_size * 4 > spill_bytes
            spill[name] = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=spill_root)) if big else None
            # the statistics' windows are embedded during layer 0's pass: those an early stop drops never are
            streams[name] = embed_stream(self.skeleton, self.layers, name, tokens, spill[name], lazy=name == "sq")
        if ref_tokens is not None:  # the smoothed stream starts from the same embeddings as the reference
            streams["smoothed"] = embed_stream(self.skeleton, self.layers, "smoothed", ref_tokens, spill["ref"])
        return streams

    def quantize_layer(
        self,
        i: int,
        streams: dict[str, Stream],
        writer: ShardWriter,
        calibrated: list[LayerFactors],
        statistics: LayerStatistics | None = None,
    ) -> None:
        """Load decoder layer i, calibrate (or take its cached `statistics`) and fold its SmoothQuant factors
        (appended to `calibrated`), measure its static activation scales, write its tensors, and return it to the
        meta device."""
        prefix = f"{self.stack_name}.{i}."
        layer = self.layers[i]
        materialize(layer, source_tensors(self.reader, layer, prefix, self.model_dir), f"{self.model_dir} layer {i}")
        layer.eval()
        smooth_first = self.plan.rotation is not None and self.plan.rotation.settings.after_smoothing
        if not smooth_first:  # a residual rotation first, as in the whole-model path
            self.rotate(i, layer, streams)
        if (sq := self.plan.smoothquant) is not None:  # the statistics' stream passes layer i unsmoothed, the
            mappings = cast(list[tuple[SmoothMapping, ...]], self.per_layer)[i]  # reference too (per_layer: with sq)
            calibrated.append(
                layer_factors(
                    self.skeleton,
                    layer,
                    i,
                    streams.get("sq"),
                    mappings,
                    sq.settings.alpha,
                    early_stop=sq.settings.early_stop_rule(),
                    search=self.search,
                    statistics=statistics,
                )
            )
            advance_stream(streams["ref"], layer, i)
            fold_layer(self.skeleton, calibrated[-1])
            advance_stream(streams["smoothed"], layer, i)
        if smooth_first:  # an input rotation after the smoothing's fold, as in the whole-model path
            self.rotate(i, layer, streams)
        embeddings = self.skeleton.get_input_embeddings()
        if i == 0 and embeddings is not None:  # every stream is embedded now: the (vocabulary-sized) table is
            embeddings.to("meta")  # not needed again
        gptq_scales = {}
        if self.plan.gptq is not None:  # as the whole-model path: after SmoothQuant's fold, before static scales
            g, search = self.plan.gptq.settings, self.plan.mse_scales
            gptq_scales = gptq_layer(
                layer, prefix, i, streams["gptq"], self.plan.scheme_of, g.block_size, g.dampening, search, g.act_order
            )
            advance_stream(streams["gptq"], layer, i)
        amax = {}
        if self.plan.static_scales is not None:
            names = [n for n in self.plan.quantized if n.startswith(prefix)]
            with ChannelMaxObserver(self.skeleton, names) as observer:
                advance_stream(streams["static"], layer, i)
            missing = [n for n in names if n not in observer.maxima]
            if missing:
                raise RuntimeError(f"static activation calibration: these linears were never called: {missing}")
            amax = {n: m.max().reshape(1) for n, m in observer.maxima.items()}
        quantized = self.plan.matrix_schemes
        state = {prefix + k: v for k, v in output.checkpoint_state(layer).items()}
        matrices = {prefix + k: v for k, v in output.quantizable_weights(layer).items() if prefix + k in quantized}
        for key, tensor in self.finish_state(state, matrices, amax, gptq_scales).items():
            writer.add(key, tensor)
        del state, matrices
        layer.to("meta")

    def rotate(self, i: int, layer: nn.Module, streams: dict[str, Stream]) -> None:
        """Rotate the materialized decoder layer i (nothing without rotation), the check streams passing it before
        (`unrotated`) and after (`rotated`)."""
        if self.rotation is None:
            return
        advance_stream(streams["unrotated"], layer, i)
        rotate_layer(self.rotation, i, self.rotation_q)
        advance_stream(streams["rotated"], layer, i)

    @torch.no_grad()
    def verify_rotation(self, unrotated: Stream, rotated: Stream) -> RotationReport:
        """Rotation's function check, layer by layer: the rotated model's logits (its rotated final norm and head,
        in memory) of the rotated windows' last hidden states against those of the unrotated ones times Q, which
        are the source model's logits in exact arithmetic; within `quantkit.quantize.rotation.TOLERANCE` of the
        logit scale, else FunctionPreservationError (nothing written). The figures differ from the whole-model
        path's (that one compares whole forwards), the weights do not."""
        q = self.rotation_q  # empty without a residual rotation: the hidden states themselves are expected
        hidden = [unrotated.hidden[b] for b in range(len(unrotated.hidden))]
        expected = [(h.double() @ q).float() if q.numel() else h for h in hidden]
        architecture = type(self.skeleton).__name__
        change, scale = logit_change(self.skeleton, self.layers, expected, rotated.hidden, architecture)
        check_rotation_preserved(architecture, change, scale)
        settings = cast(RotationStep, self.plan.rotation).settings
        plan = cast(RotationPlan, self.rotation)
        block = settings.block if settings.residual else None
        return RotationReport(settings.seed, plan.online_hadamard, change, scale, block, settings.residual)


def _verify(
    skeleton: nn.Module,
    layers: nn.ModuleList,
    ref: Stream,
    smoothed: Stream,
    plan: MappingPlan,
    step: SmoothQuantStep,
    tokens: torch.Tensor,
    calibrated: list[LayerFactors],
) -> SmoothQuantReport:
    """smooth_model's function-preservation check on the carried verification windows; its report."""
    change, scale = check_preserved(
        skeleton, layers, ref.hidden, smoothed.hidden, plan.architecture, DEFAULT_TOLERANCE, "nothing was written"
    )
    sq, grid = step.settings, None if step.search is None else step.search.searched_values()
    report = smoothquant_report(
        plan, sq.alpha, tokens, calibrated, change, scale, DEFAULT_TOLERANCE, sq.early_stop_rule(), grid
    )
    logger.info("SmoothQuant done (streaming):\n%s", report.summary())
    return report
