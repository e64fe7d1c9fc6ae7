"""Quality of a quantized checkpoint against its source, before any serving.

- Per-layer quantization SNR (dB) of every quantized Linear: the layer's own output error on the
  REFERENCE model's inputs, 10 log10(sum y^2 / sum (y - y_q)^2), y = x W^T and y_q = fq(x) W_q^T
  (`quantkit.metrics.snr_db`, energies summed in float64).
- The same per quantized expert matrix `<experts>.<e>.<proj>` of fused routed experts (MoE), on the tokens
  the reference router sends to expert e (`quantkit.quantize.routed_experts`): gate_proj / up_proj read the
  block's input x, down_proj reads h = act(x gate_e^T) * (x up_e^T) of the reference; x and h are
  fake-quantized as the quantized checkpoint's experts do (`FakeQuantExperts`). An expert no token reaches has
  no SNR. Summarized per experts module and projection as min / median over experts (`expert_snr_db`, the
  second table).
  For SmoothQuant checkpoints the reference is the source with the checkpoint's own SmoothQuant factors folded
  in (`smoothquant_factors.pt`; function-preserving, so KL is unaffected), so that x and W match W_q.
- Top-1 agreement: the fraction of held-out positions whose most likely next token the two models agree on (what
  greedy decoding picks; a measure of the few positions where noise changes a choice, which KL averages away).
- Whole-model KL(ref || quantized) of the next-token distributions, mean over held-out tokens (nats;
  `quantkit.metrics.kl_divergence`, float64).
- Rotated checkpoints (`quantkit.quantize.rotation`): the quantized stream starts from the checkpoint's own (rotated)
  embeddings and ends at its own head. With a residual rotation the reference is the source rotated as the checkpoint
  records it (`rotation`: seed, residual block, online Hadamard blocks; function-preserving, so KL is unaffected),
  one layer at a time with the functions quantize used (`rotate_outside`, `rotate_layer`), so each quantized layer's
  SNR is measured on the rotated input it reads; a reference layer with an online Hadamard hands the fake-quant
  layer its input before the transform (the fake-quant layer applies it itself). Without a residual rotation
  (`residual: false`) each quantized layer reads the unrotated reference's input and transforms it itself.

- Block SNR of every decoder layer's blocks (its children holding quantized modules: self_attn, mlp, linear_attn):
  after the reference layer, the quantized layer runs on the same input, its norms reading what the reference's
  read, and each block's output is compared with the reference block's (`_block_hooks`). A block's output is where
  a transform folded inside it cancels, so the figure needs no record of it: a peer's checkpoint (compressed-tensors
  NVFP4 from llm-compressor, `quantkit.quantize.peer_fake_quant`), whose AWQ scales are folded in unrecorded, gets
  block SNR and KL only (no per-layer SNR: its layers' inputs are not the reference's).

Both models run one decoder layer at a time (`quantkit.calibrate.layers`), so memory does not grow with depth.

    quantkit quality MODEL_DIR QUANTIZED_DIR [QUANTIZED_DIR ...]   -> markdown tables (+ --json)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer

import quantkit.calibrate.layers as layer_engine
import quantkit.models  # noqa: F401
from quantkit.calibrate.mappings import SmoothMapping, resolve_mappings
from quantkit.calibrate.smoothquant import fold_mapping
from quantkit.checkpoints import CheckpointError, TensorReader, check_checkpoint_dir, source_record, weights_fingerprint
from quantkit.data import calibration_windows, heldout_windows
from quantkit.errors import QuantkitError
from quantkit.formats.experts import EXPERT_PROJECTIONS, expert_matrices
from quantkit.formats.hadamard import residual_rotation
from quantkit.formats.schemes import checkpoint_suffixes
from quantkit.metrics import energy, kl_divergence, sensitivity_by_kind, snr_db
from quantkit.quantize.fake_quant import FakeQuantExperts, install_fake_quant, read_quantization_config
from quantkit.quantize.output import read_smoothquant_factors
from quantkit.quantize.peer_fake_quant import install_peer_fake_quant, is_peer_config, read_peer_quantization_config
from quantkit.quantize.rotation import RotationPlan, plan_rotation, rotate_layer, rotate_outside
from quantkit.quantize.routed_experts import (
    experts_call,
    projection_outputs,
    routed_expert_passes,
    summarize_expert_snr,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@torch.no_grad()
def quality(reference_dir: str | Path, quantized_dir: str | Path, tokens: torch.Tensor) -> dict:
    """{'recipe', 'kl', 'kl_per_window', 'top1_agreement', 'layer_snr_db': {name: dB}, 'min_snr_db', 'mean_snr_db',
    'expert_snr_db', 'sensitivity', 'block_snr_db', 'block_sensitivity'} on token windows (N, T); kl is the mean over
    every position (nats/token), kl_per_window each window's mean (N values: paired comparisons of two checkpoints on
    the same windows); top1_agreement the fraction of positions whose most likely next token both models agree on
    (greedy decoding's choice); layer_snr_db holds Linears and expert matrices (none for a peer's checkpoint), min /
    mean are over all of them; sensitivity: per projection kind (`sensitivity_by_kind`); block_snr_db
    {'<layer>.<block>': dB} and block_sensitivity the same per block kind. The quantized layer runs twice per layer:
    on its own stream and, for block SNR, on the reference's.

    The windows are embedded once per model (the checkpoint keeps the embeddings as the source stores them), then
    layer by layer the reference layer (float32 from the source, with the checkpoint's SmoothQuant factors folded
    in) and the fake-quant layer (`install_fake_quant`) carry their own hidden states, the SNR hooks reading the
    reference's (`_layers`); at the end each model's own head gives the logits `HEAD_POSITIONS` positions at a time
    (`_head_kl`). Peak memory: the larger of the input embeddings and the lm_head in float32 (an unquantized
    lm_head equal in both checkpoints is held once; a residual-rotated checkpoint's reference holds both while the
    quantized embeddings are read), one layer of each model, and the hidden states of the windows
    (N x T x hidden x 4 bytes, per model)."""
    layer_engine.pin_mmap_threshold()
    reference_dir, quantized_dir = Path(reference_dir), Path(quantized_dir)
    qc = read_any_quantization_config(quantized_dir)
    reference = layer_engine.skeleton_model(AutoConfig.from_pretrained(reference_dir))
    q_config = AutoConfig.from_pretrained(quantized_dir)
    del q_config.quantization_config
    quantized = layer_engine.skeleton_model(q_config)
    source, packed = layer_engine.open_source(reference_dir, reference.config.model_type), TensorReader(quantized_dir)
    stack, ref_layers = layer_engine.decoder_stack(reference)
    tied = layer_engine.tied_partners(reference)  # before the embeddings go back to the meta device (untying them)
    before_head, head_keys = layer_engine.outside_keys(reference)
    head = layer_engine.head_name(reference)
    # a residual rotation (not `residual: false`, whose layers read the reference's inputs and transform them inside)
    rotation = _reference_rotation(reference, qc)
    if rotation is not None:  # the whole outside loaded first: rotate_outside folds the final norm into the head
        layer_engine.load_outside(reference, source, before_head + head_keys, tied)
        rotate_outside(reference, *rotation)
    else:
        layer_engine.load_outside(reference, source, before_head, tied)
    streams = [layer_engine.embed_stream(reference, ref_layers, "reference", tokens, None)]
    if rotation is not None:  # its own rotated embeddings (and every other tensor before the layers)
        _load_fake_quant(quantized, quantized, "", packed, qc, quantized_dir, keys=before_head)
        streams.append(
            layer_engine.embed_stream(quantized, layer_engine.decoder_stack(quantized)[1], "quantized", tokens, None)
        )
        quantized.get_input_embeddings().to("meta")
    else:
        streams.append(layer_engine.embed_stream(reference, ref_layers, "quantized", tokens, None))
    reference.get_input_embeddings().to("meta")

    signal: dict[str, float] = {}
    noise: dict[str, float] = {}
    blocks: tuple[dict[str, float], dict[str, float]] = ({}, {})
    _layers(reference, quantized, source, packed, qc, streams, (signal, noise), blocks, rotation)
    # compared in the stored dtype before the reference's float32 head is loaded: the peak holds one head copy
    shared_head = head is not None and _same_unquantized(source, packed, f"{head}.weight", tied, qc)
    if rotation is None:  # (a rotated reference's head is loaded and rotated already)
        layer_engine.load_outside(reference, source, head_keys, tied)
    q_outside = [k for k in before_head if not k.startswith(_input_embeddings_prefix(reference))]
    _load_fake_quant(quantized, quantized, "", packed, qc, quantized_dir, keys=q_outside)
    if shared_head:
        quantized.get_submodule(head).weight = reference.get_submodule(head).weight  # one copy of the same tensor
    elif head is not None:
        _load_fake_quant(quantized, quantized, "", packed, qc, quantized_dir, keys=head_keys, tied=tied)
    modules = dict(reference.named_modules())
    outside_quantized = [n for n in _matched_modules(qc) if not n.startswith(f"{stack}.") and n in modules]
    with _snr_hooks(reference, quantized, outside_quantized, set(qc["quantized_modules"]), signal, noise):
        per_window, top1 = _head_kl(reference, quantized, streams)
    snr = {n: snr_db(signal[n], noise[n]) for n in signal}  # expert matrices: those some token reached
    block_snr = {n: snr_db(blocks[0][n], blocks[1][n]) for n in blocks[0]}
    return {
        "recipe": qc["recipe"],
        "kl": sum(per_window) / len(per_window),  # every window has T positions: the mean over all of them
        "kl_per_window": per_window,
        "top1_agreement": sum(top1) / len(top1),  # every window has T positions: the mean over all of them
        "layer_snr_db": snr,
        "min_snr_db": min(snr.values()) if snr else None,
        "mean_snr_db": sum(snr.values()) / len(snr) if snr else None,
        "expert_snr_db": summarize_expert_snr(snr),
        "sensitivity": sensitivity_by_kind(snr),
        "block_snr_db": block_snr,
        "block_sensitivity": sensitivity_by_kind(block_snr),
    }


def _layers(
    reference: torch.nn.Module,
    quantized: torch.nn.Module,
    source: TensorReader,
    packed: TensorReader,
    qc: dict,
    streams: list[layer_engine.Stream],
    linears: tuple[dict[str, float], dict[str, float]],
    blocks: tuple[dict[str, float], dict[str, float]],
    rotation: tuple[RotationPlan, torch.Tensor] | None = None,
) -> None:
    """The two streams through the decoder layers, one layer of each model in memory at a time, with the SNR
    hooks on the reference's quantized modules (`linears`: signal / noise accumulate per module name; none for a
    peer's checkpoint, `_matched_modules`) and on each layer's blocks (`blocks`, `_block_hooks`). rotation: the
    reference's residual rotation (`_reference_rotation`; none for an input rotation, whose transform lives in the
    quantized modules), each layer rotated right after it is materialized, before SmoothQuant's factors are folded
    (quantize's order for a residual rotation)."""
    stack, ref_layers = layer_engine.decoder_stack(reference)
    _, q_layers = layer_engine.decoder_stack(quantized)
    mappings: Sequence[SmoothMapping] = []
    factors: dict[str, torch.Tensor] = {}
    if qc["smoothquant"]:
        factors = read_smoothquant_factors(packed.model_dir)
        flags = {k: v for k, v in qc["smoothquant"].items() if k in ("include_v_o", "include_up_down", "experts")}
        mappings = resolve_mappings(reference, **flags).mappings
    quantized_set, matched = set(qc["quantized_modules"]), set(_matched_modules(qc))
    for i in tqdm(range(len(ref_layers)), desc=f"quality {qc['recipe']}", unit="layer"):
        prefix = f"{stack}.{i}."
        ref_layer = ref_layers[i]
        layer_engine.materialize(
            ref_layer,
            layer_engine.source_tensors(source, ref_layer, prefix, source.model_dir),
            f"{source.model_dir} layer {i}",
        )
        if rotation is not None:
            rotate_layer(rotation[0], i, rotation[1])
        for m in mappings:
            if m.smooth.startswith(prefix):
                fold_mapping(reference, m, factors[m.smooth])
        _load_fake_quant(quantized, q_layers[i], prefix, packed, qc, packed.model_dir)
        hooked = [n for n in matched if n.startswith(prefix)]
        with (
            _snr_hooks(reference, quantized, hooked, quantized_set, *linears),
            _block_hooks(ref_layer, q_layers[i], prefix, quantized_set, *blocks),
        ):
            layer_engine.advance_stream(streams[0], ref_layer, i)
        layer_engine.advance_stream(streams[1], q_layers[i], i)
        ref_layer.to("meta")
        q_layers[i].to("meta")


def _matched_modules(qc: dict) -> list[str]:
    """The quantized modules whose input in the reference is the one the checkpoint's module reads: every one of a
    quantkit checkpoint (its SmoothQuant factors and rotation are recorded and applied to the reference), none of a
    peer's (whose AWQ or SmoothQuant scales are folded in without a record)."""
    return [] if is_peer_config(qc) else list(qc["quantized_modules"])


@contextmanager
def _block_hooks(
    ref_layer: torch.nn.Module,
    q_layer: torch.nn.Module,
    prefix: str,
    quantized: set[str],
    signal: dict[str, float],
    noise: dict[str, float],
) -> Iterator[None]:
    """Block SNR of decoder layer `prefix`: after each call of the reference layer, the quantized layer runs on the
    same input and arguments, every child of it that is not a block (norms: the checkpoint's own, SmoothQuant's or
    AWQ's scales folded in) reading the input the reference's same child read; each block's (a child holding a
    quantized module: self_attn, mlp, linear_attn) output y_q is compared with the reference block's y, adding
    sum y^2 and sum (y_q - y)^2 under `prefix + child`. A block's output is where the transforms a quantizer folds
    inside it cancel (per-channel scales between a norm or a projection and its consumers, online Hadamards), so
    this measures quantkit's and a peer's checkpoints alike: the noise of the block's quantized modules together,
    on the reference's input."""
    children = dict(ref_layer.named_children())
    blocks = [c for c in children if any(n.startswith(f"{prefix}{c}.") for n in quantized)]
    others = [c for c in children if c not in blocks]
    inputs: dict[str, list] = {c: [] for c in others}  # the reference children's (args, kwargs), in call order
    outputs: dict[str, list[torch.Tensor]] = {c: [] for c in blocks}

    def keep_input(_, args, kwargs, child):
        inputs[child].append((args, kwargs))

    def keep_output(_, args, out, store):
        store.append(out[0] if isinstance(out, tuple) else out)

    def replay(_, args, kwargs, _out):
        q_children = dict(q_layer.named_children())
        q_outputs: dict[str, list[torch.Tensor]] = {c: [] for c in blocks}
        hooks = [
            q_children[c].register_forward_pre_hook(lambda _m, _a, _k, c=c: inputs[c].pop(0), with_kwargs=True)
            for c in others
        ]
        hooks += [q_children[c].register_forward_hook(partial(keep_output, store=q_outputs[c])) for c in blocks]
        try:
            q_layer(*args, **kwargs)
        finally:
            for h in hooks:
                h.remove()
        for c in blocks:
            for y, y_q in zip(outputs[c], q_outputs[c], strict=True):
                signal[prefix + c] = signal.get(prefix + c, 0.0) + energy(y)
                noise[prefix + c] = noise.get(prefix + c, 0.0) + energy(y_q - y)
            outputs[c].clear()
        for c in others:
            inputs[c].clear()

    hooks = [children[c].register_forward_pre_hook(partial(keep_input, child=c), with_kwargs=True) for c in others]
    hooks += [children[c].register_forward_hook(partial(keep_output, store=outputs[c])) for c in blocks]
    hooks.append(ref_layer.register_forward_hook(replay, with_kwargs=True))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def read_any_quantization_config(model_dir: str | Path) -> dict:
    """A quantized checkpoint's quantization_config as quality reads it: quantkit's (`read_quantization_config`)
    or a peer's NVFP4 one (`quantkit.quantize.peer_fake_quant.read_peer_quantization_config`)."""
    config, headers = check_checkpoint_dir(model_dir)
    qc = config.get("quantization_config")
    if is_peer_config(qc):
        return read_peer_quantization_config(Path(model_dir), qc, headers)
    return read_quantization_config(model_dir)


def _reference_rotation(reference: PreTrainedModel, qc: dict) -> tuple[RotationPlan, torch.Tensor] | None:
    """The residual rotation the checkpoint records (`quantization_config.rotation`), as the plan and Q that
    rotate the reference (on the meta device) the same way; None without one. The online Hadamard blocks are the
    recorded ones, not re-derived."""
    record = qc.get("rotation")
    if not record or not record.get("residual", True):
        return None
    plan = replace(plan_rotation(reference, online=False), online_hadamard=dict(record["online_hadamard"]))
    hidden = reference.get_input_embeddings().embedding_dim
    return plan, residual_rotation(hidden, record["seed"], record.get("residual_block"))


def _head_kl(
    reference: torch.nn.Module, quantized: torch.nn.Module, streams: list[layer_engine.Stream]
) -> tuple[list[float], list[float]]:
    """Per window, the mean KL(reference || quantized) of the next-token distributions over its positions, and the
    fraction of its positions whose most likely next token is the same in both models (greedy decoding's choice;
    ties go to the lower token id in both): each model's final norm and head on `HEAD_POSITIONS` positions of one
    window at a time (float64 copies of (1, 64, V): ~0.1 GB at V = 152k)."""
    _, ref_layers = layer_engine.decoder_stack(reference)
    _, q_layers = layer_engine.decoder_stack(quantized)
    per_window, top1 = [], []
    for b in range(len(streams[0].hidden)):
        for ref_hidden, q_hidden in zip(streams[0].hidden[b].split(1), streams[1].hidden[b].split(1)):
            kl_sum, same = 0.0, 0
            for start in range(0, ref_hidden.shape[1], layer_engine.HEAD_POSITIONS):
                ref_logits = layer_engine.head_logits(reference, ref_layers, ref_hidden, start)
                q_logits = layer_engine.head_logits(quantized, q_layers, q_hidden, start)
                kl_sum += kl_divergence(ref_logits, q_logits).sum().item()
                same += int((ref_logits.argmax(-1) == q_logits.argmax(-1)).sum().item())
            per_window.append(kl_sum / ref_hidden.shape[1])
            top1.append(same / ref_hidden.shape[1])
    return per_window, top1


def _input_embeddings_prefix(model: PreTrainedModel) -> str:
    embeddings = model.get_input_embeddings()
    return next(f"{n}." for n, m in model.named_modules() if m is embeddings)


def _load_fake_quant(
    model: torch.nn.Module,
    module: torch.nn.Module,
    prefix: str,
    packed: TensorReader,
    qc: dict,
    model_dir: Path,
    keys: list[str] | None = None,
    tied: dict[str, str] | None = None,
) -> None:
    """Fill `module` (on the meta device; named prefix in `model`) from the quantized checkpoint: its quantized
    linears and experts as fake-quant modules, the rest float32. keys: only these of the module's state (default:
    every checkpoint tensor under prefix); tied: read a key the checkpoint does not store from its partner."""
    if keys is None:
        names = [k for k in packed.names if k.startswith(prefix)]
        state = {k: packed[k] for k in names}
    else:
        state = {}
        for key in keys:
            quantized_module = key.rpartition(".")[0] in qc["quantized_modules"]
            stored = [f"{key.rpartition('.')[0]}.{s}" for s in checkpoint_suffixes()] if quantized_module else [key]
            for k in stored:
                source = k if k in packed else (tied or {}).get(k)
                if source is not None and source in packed:
                    state[k] = packed[source]
    only = None if keys is None else {k.rpartition(".")[0] for k in keys}
    if is_peer_config(qc):
        rest = install_peer_fake_quant(module, prefix, state, qc, model_dir, only)
    else:
        rest = install_fake_quant(module, prefix, state, qc, True, model_dir, only)
    rest = {k: v.float() if v.is_floating_point() else v for k, v in rest.items()}
    try:
        module.load_state_dict(rest, strict=False, assign=True)
    except RuntimeError as err:
        raise CheckpointError(
            f"{model_dir}: the checkpoint's tensors under {prefix or 'the model'} do not fit: {err}"
        ) from err
    meta = [n for n, t in module.named_parameters() if t.is_meta and (keys is None or n in keys)]
    if meta:
        raise CheckpointError(f"{model_dir}: the checkpoint has no tensors for {[prefix + n for n in meta][:5]}")


def _same_unquantized(source: TensorReader, packed: TensorReader, key: str, tied: dict[str, str], qc: dict) -> bool:
    """Whether the quantized checkpoint holds `key` unquantized with the source's exact bytes (dtype included)."""
    if key.rpartition(".")[0] in qc["quantized_modules"]:
        return False
    a, b = (key if key in r else tied.get(key) for r in (source, packed))
    if a is None or b is None or a not in source or b not in packed:
        return False
    x, y = source[a], packed[b]
    return x.dtype == y.dtype and torch.equal(x, y)


@contextmanager
def _snr_hooks(
    reference: torch.nn.Module,
    quantized: torch.nn.Module,
    names: list[str],
    quantized_set: set[str],
    signal: dict[str, float],
    noise: dict[str, float],
) -> Iterator[None]:
    """Forward hooks on the reference's quantized linears `names` and on the fused experts under them: add sum y^2
    and sum (y - y_q)^2 per module, y_q from the same module of `quantized` on the same input."""
    modules = dict(reference.named_modules())
    hooks = []
    for name in names:
        if name not in modules:  # an expert matrix of fused experts: hooked on its experts module below
            continue
        q_layer = quantized.get_submodule(name)
        inputs: list[torch.Tensor] = []  # the input before any pre-hook (a rotated reference's online Hadamard)

        def keep_input(_, args, inputs=inputs):
            inputs.append(args[0])

        def hook(_, args, out, name=name, q_layer=q_layer, inputs=inputs):
            signal[name] = signal.get(name, 0.0) + energy(out)
            noise[name] = noise.get(name, 0.0) + energy(q_layer(inputs.pop()) - out)

        hooks.append(modules[name].register_forward_pre_hook(keep_input, prepend=True))
        hooks.append(modules[name].register_forward_hook(hook))
    prefixes = {n.rpartition(".")[0].rpartition(".")[0] for n in names if n not in modules}  # <experts>.<e>.<proj>
    for name in prefixes:
        q_experts = quantized.get_submodule(name)
        if isinstance(q_experts, FakeQuantExperts):
            hooks.append(
                modules[name].register_forward_hook(
                    _experts_snr_hook(name, q_experts, quantized_set, signal, noise), with_kwargs=True
                )
            )
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _experts_snr_hook(
    name: str, q_experts: FakeQuantExperts, quantized: set[str], signal: dict[str, float], noise: dict[str, float]
):
    """Forward hook on the reference's fused experts `name`: per routed expert and quantized matrix, add
    sum y^2 and sum (y - y_q)^2 (y on the reference's input, y_q = fq(input) W_q^T as `q_experts` computes)."""
    decoded = expert_matrices(name, q_experts)  # "<name>.<e>.<proj>" -> the checkpoint's decoded matrix

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, _output: torch.Tensor) -> None:
        hidden, top_k_index, _ = experts_call(args, kwargs)
        for p in routed_expert_passes(module, hidden, top_k_index):
            for proj, (x, y) in projection_outputs(p).items():
                matrix = f"{name}.{p.expert}.{proj}"
                if matrix not in quantized:
                    continue
                x_q = q_experts.fake_quant_input(
                    x, p.expert, 1 if proj == "down_proj" else 0
                )  # input 0: gate/up, 1: down
                y_q = torch.nn.functional.linear(x_q, decoded[matrix])
                signal[matrix] = signal.get(matrix, 0.0) + energy(y)
                noise[matrix] = noise.get(matrix, 0.0) + energy(y_q - y)

    return hook


class SourceMismatchError(QuantkitError, ValueError):
    """`quality` was given a source that is not the one the quantized checkpoint was made from (its SOURCE_RECORD),
    or a quantized checkpoint as the source: the KL and SNR would measure the difference of two models."""


def check_source(reference_dir: str | Path, quantized_dirs: list[str | Path], any_source: bool = False) -> None:
    """The source is unquantized and, unless `any_source`, the one each quantized checkpoint records
    (`quantkit.checkpoints.source_record`; checkpoints without a record are taken as they are)."""
    config, _ = check_checkpoint_dir(reference_dir)
    if config.get("quantization_config") is not None:
        raise SourceMismatchError(
            f"{reference_dir} is a quantized checkpoint: quality compares quantized checkpoints with their "
            "unquantized source (pass the source first)"
        )
    if any_source:
        return
    fingerprint = weights_fingerprint(reference_dir)
    for model_dir in quantized_dirs:
        record = source_record(model_dir)
        if record is not None and record["fingerprint"] != fingerprint:
            raise SourceMismatchError(
                f"{model_dir} was quantized from {record.get('path')} (weights fingerprint "
                f"{record['fingerprint'][:12]}), not from {reference_dir} ({fingerprint[:12]}): pass its source, "
                "or --any-source to compare with another model anyway"
            )


def quality_table(
    reference_dir: str | Path,
    quantized_dirs: list[str | Path],
    num_sequences: int = 16,
    seq_len: int = 256,
    any_source: bool = False,
    data: str | None = None,
) -> tuple[str, list[dict]]:
    """Markdown table (one row per quantized checkpoint) and the per-checkpoint dicts, on held-out text (the held-out
    speeches, `heldout_windows`), or with `data` on windows of that text source (`quantkit.data.calibration_windows`:
    a built-in corpus or a .txt / .jsonl file, e.g. the evaluation's own domain). Every input is checked first
    (`check_source`; `any_source` skips the source-identity check)."""
    for model_dir in (reference_dir, *quantized_dirs):  # every input, before any model is loaded
        check_checkpoint_dir(model_dir)
    for model_dir in quantized_dirs:
        read_any_quantization_config(model_dir)
    check_source(reference_dir, quantized_dirs, any_source)
    tokenizer = AutoTokenizer.from_pretrained(reference_dir)
    if data is None:
        tokens = heldout_windows(tokenizer, num_sequences, seq_len)
    else:
        tokens = calibration_windows(tokenizer, num_sequences, seq_len, data)
    rows = [quality(reference_dir, d, tokens) for d in quantized_dirs]
    lines = [
        "| recipe | KL vs source (nats/token) | top-1 agreement | min layer SNR (dB) | mean layer SNR (dB) "
        "| worst layer |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['recipe']} | {r['kl']:.2e} | {100 * r['top1_agreement']:.2f}%"
        if not r["layer_snr_db"]:  # nothing quantized inside the layers or at the head (or a peer's checkpoint)
            lines.append(f"{head} | - | - | - |")
            continue
        worst = min(r["layer_snr_db"], key=r["layer_snr_db"].get)
        lines.append(f"{head} | {r['min_snr_db']:.1f} | {r['mean_snr_db']:.1f} | {worst} |")
    kinds = list(dict.fromkeys(kind for r in rows for kind in r["block_sensitivity"]))
    if kinds:  # the blocks' noise, a peer's checkpoint's too
        lines += [
            "",
            "| recipe | " + " | ".join(f"{k} block SNR mean (min @ layer), dB" for k in kinds) + " |",
            "|---|" + "---|" * len(kinds),
        ]
        for r in rows:
            lines.append(f"| {r['recipe']} | {' | '.join(_kind_cell(r['block_sensitivity'], k) for k in kinds)} |")
    kinds = list(dict.fromkeys(kind for r in rows for kind in r["sensitivity"]))
    if kinds:  # where each recipe's noise sits: one column per projection kind, least SNR first (the first recipe)
        lines += [
            "",
            "| recipe | " + " | ".join([f"{kinds[0]} SNR mean (min @ layer), dB", *kinds[1:]]) + " |",
            "|---|" + "---|" * len(kinds),
        ]
        for r in rows:
            lines.append(f"| {r['recipe']} | {' | '.join(_kind_cell(r['sensitivity'], k) for k in kinds)} |")
    if any(r["expert_snr_db"] for r in rows):  # MoE: one row per recipe and experts module
        lines += [
            "",
            "| recipe | experts | gate_proj SNR min / median (dB) | up_proj | down_proj | worst expert matrix |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            for experts, by_proj in r["expert_snr_db"].items():
                cells = [
                    f"{v['min']:.1f} / {v['median']:.1f}" if (v := by_proj.get(p)) else "-" for p in EXPERT_PROJECTIONS
                ]
                proj, v = min(by_proj.items(), key=lambda kv: kv[1]["min"])
                lines.append(
                    f"| {r['recipe']} | {experts} | {' | '.join(cells)} | {experts}.{v['min_expert']}.{proj} |"
                )
    return "\n".join(lines), rows


def _kind_cell(table: dict[str, dict], kind: str) -> str:
    """'mean (min @ layer)' of one kind of a `sensitivity_by_kind` table, '-' where the recipe has none."""
    c = table.get(kind)
    return f"{c['mean_db']:.1f} ({c['min_db']:.1f} @ {c['worst_layer']})" if c else "-"
