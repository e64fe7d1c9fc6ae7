"""A causal LM's forward in pieces: the layer-by-layer engine of streaming quantize, quality and diagnose.

- The model as a skeleton on the meta device (`skeleton_model`: names and shapes, no data); a module's tensors
  read from the checkpoint one at a time (`source_tensors`, `outside_state`) and given to it (`materialize`),
  then sent back to the meta device: one decoder layer in memory at a time.
- Token windows carried through the decoder stack layer by layer (`Stream`): `embed_stream` runs the model's
  own forward up to its first decoder layer and records the keyword arguments the model passes every layer
  (position embeddings, the mask of its layer type); `advance_stream` runs one layer on every batch.
- The head in pieces: the last decoder layer's output (`final_hidden`) and the model's own final norm and head
  on HEAD_POSITIONS positions at a time (`head_logits`): (B, 64, V) float32, ~40 MB per window at V = 152k
  instead of ~0.3 GB. The whole-model and layer-by-layer paths cut the same pieces, so they compute the same bits.
- A source checkpoint is read under the transformers model's names even where it is stored in the layout
  transformers converts at load (`open_source`, `stored_names`: e.g. Mixtral's hub names); the arguments of
  each layer can be had without running any (`layer_arguments`: SmoothQuant's traced rule on a skeleton).
- `pin_mmap_threshold`: freed layer-sized tensors go back to the OS (glibc), so memory stays flat over depth.
"""

from __future__ import annotations

import ctypes
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from quantkit.checkpoints import CheckpointError, TensorReader
from quantkit.errors import QuantkitError
from quantkit.formats.experts import fuse_expert_matrices, fused_experts_modules
from quantkit.models.attention import reference_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

HEAD_POSITIONS = 64  # positions per head_logits call
BATCH_SIZE = 8  # windows per batch: smooth_model's and channel_max's default (the same batches give the same bits)


class LayerwiseError(QuantkitError, ValueError):
    """The model's structure does not allow running it layer by layer (the message says what and why)."""


class StopForward(Exception):
    """Raised inside a model's forward to end it early, carrying the hidden states (B, T, hidden) reached."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("stop after the last decoder layer")
        self.hidden = hidden


def find_decoder_stack(model: nn.Module) -> nn.ModuleList | None:
    """model.model.layers (every transformers decoder and quantkit's families), or None where the model has none."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) > 0 else None


def decoder_stack(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """("model.layers", the decoder layers); LayerwiseError where the model keeps none there."""
    layers = find_decoder_stack(model)
    if layers is None:
        raise LayerwiseError(
            f"{type(model).__name__} has no decoder layers at model.model.layers; running it layer by layer needs them"
        )
    return "model.layers", layers


@contextmanager
def layer_forwards(layers: nn.ModuleList, fn: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Replace each decoder layer's forward by fn(i, hidden_states, *args, **kwargs) (an instance attribute: the
    model's loop, its mask choice by layer type and the layer's __call__ stay the real ones)."""
    for i, layer in enumerate(layers):
        layer.forward = lambda hidden_states, *args, _i=i, **kwargs: fn(_i, hidden_states, *args, **kwargs)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


@torch.no_grad()
def layer_arguments(model: nn.Module, layers: nn.ModuleList, inputs_embeds: torch.Tensor) -> list[dict]:
    """The keyword arguments the model's forward gives each decoder layer for inputs_embeds (B, T, hidden)
    (position embeddings, the mask of its layer type); no layer runs, so the layers may be on the meta device."""
    recorded: list[dict] = []
    last = len(layers) - 1

    def record(i: int, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args:
            raise LayerwiseError(f"the model passes decoder layer {i} positional arguments besides the hidden states")
        recorded.append(kwargs)
        if i == last:
            raise StopForward(hidden_states)
        return hidden_states

    with layer_forwards(layers, record):
        try:
            model(inputs_embeds=inputs_embeds, use_cache=False)
        except StopForward:
            return recorded
    raise LayerwiseError(f"{type(model).__name__}'s forward did not call its last decoder layer")


@torch.no_grad()
def final_hidden(model: nn.Module, layers: nn.ModuleList, input_ids: torch.Tensor) -> torch.Tensor:
    """The last decoder layer's output (B, T, hidden) for input_ids (B, T); the final norm and head do not run."""

    def stop(_module: nn.Module, _args: tuple, output: torch.Tensor) -> None:
        raise StopForward(output)

    hook = layers[-1].register_forward_hook(stop)
    try:
        model(input_ids=input_ids, use_cache=False)
    except StopForward as stopped:
        return stopped.hidden
    finally:
        hook.remove()
    raise RuntimeError(f"{type(model).__name__}'s forward did not call its last decoder layer")


@torch.no_grad()
def head_logits(model: nn.Module, layers: nn.ModuleList, hidden: torch.Tensor, start: int) -> torch.Tensor:
    """float32 logits (B, n, V) of positions start .. start + HEAD_POSITIONS of `hidden` (B, T, hidden: the last
    decoder layer's output): the model's own forward with its decoder layers replaced (the last one returns
    `hidden`), so its final norm, head and any logit transform (e.g. Gemma's softcap) apply as they do in use."""
    last = len(layers) - 1
    positions = torch.arange(start, min(start + HEAD_POSITIONS, hidden.shape[1]), device=hidden.device)
    with layer_forwards(layers, lambda i, h, *args, **kwargs: hidden if i == last else h):
        return model(inputs_embeds=hidden, use_cache=False, logits_to_keep=positions).logits.float()


# --------------------------------------------------------------------------------------------- streams


class _Batches:
    """A stream's per-batch hidden states, in memory or (spill_dir set) one torch.save file a batch."""

    def __init__(self, spill_dir: Path | None) -> None:
        self.spill_dir = spill_dir
        self._items: list[torch.Tensor | Path] = []

    def append(self, t: torch.Tensor) -> None:
        if self.spill_dir is None:
            self._items.append(t)
            return
        fd, name = tempfile.mkstemp(suffix=".pt", dir=self.spill_dir)
        os.close(fd)
        path = Path(name)
        torch.save(t, path)
        self._items.append(path)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> torch.Tensor:
        item = self._items[i]
        return torch.load(item, weights_only=True) if isinstance(item, Path) else item

    def discard(self) -> None:
        for item in self._items:
            if isinstance(item, Path):
                item.unlink()
        self._items.clear()


@dataclass
class Stream:
    """Token windows carried layer by layer: per batch of BATCH_SIZE windows, the keyword arguments the model gives
    each layer, and the hidden states entering the next layer. A lazy stream (`embed_stream(lazy=True)`) holds no
    hidden states yet: decoder layer 0's pass embeds each batch just before it (`embed`), so batches an early stop
    drops are never embedded."""

    name: str
    chunks: list[torch.Tensor]  # (B, T) int64 token batches
    layer_kwargs: list[list[dict]]  # [batch][layer]
    hidden: _Batches
    embed: Callable[[int], torch.Tensor] | None = None  # lazy: batch b's input to layer 0 (records its kwargs)


@torch.no_grad()
def embed_stream(
    skeleton: nn.Module,
    layers: nn.ModuleList,
    name: str,
    tokens: torch.Tensor,
    spill_dir: Path | None,
    batch_size: int = BATCH_SIZE,
    lazy: bool = False,
) -> Stream:
    """Run the skeleton's forward up to the first decoder layer for each batch of `batch_size` windows of tokens
    (N, T); record every layer's keyword arguments. spill_dir: keep the hidden states there (one file a batch).
    lazy: embed each batch during layer 0's pass instead (the skeleton's embeddings must stay loaded until then)."""
    stream = Stream(
        name, [tokens[s : s + batch_size] for s in range(0, len(tokens), batch_size)], [], _Batches(spill_dir)
    )
    last = len(layers) - 1

    def record(i: int, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args:
            raise LayerwiseError(f"the model passes decoder layer {i} positional arguments besides the hidden states")
        stream.layer_kwargs[-1].append(kwargs)
        if i == last:
            raise StopForward(hidden_states)
        return hidden_states

    def embed(b: int) -> torch.Tensor:
        stream.layer_kwargs.append([])
        with layer_forwards(layers, record):
            try:
                skeleton(input_ids=stream.chunks[b], use_cache=False)
            except StopForward as stop:
                return stop.hidden
        raise LayerwiseError("the model's forward did not call its last decoder layer")

    if lazy:
        stream.embed = embed
    else:
        for b in range(len(stream.chunks)):
            stream.hidden.append(embed(b))
    return stream


@torch.no_grad()  # forward only: outside no_grad each output would keep the layer's weights alive through autograd
def advance_stream(
    stream: Stream,
    layer: nn.Module,
    i: int,
    before_batch: Callable[[int], None] | None = None,
    stop_after: Callable[[int], bool] | None = None,
) -> None:
    """Hidden states of `stream` through decoder layer i (the layer's own __call__, the model's arguments);
    before_batch(b) runs before batch b's pass. stop_after(b) True after batch b's pass ends the stream there:
    the later batches are dropped for this and every later layer."""
    out = _Batches(stream.hidden.spill_dir)
    for b in range(len(stream.chunks)):
        x = stream.embed(b) if stream.embed is not None else stream.hidden[b]
        if before_batch is not None:
            before_batch(b)
        out.append(layer(x, **stream.layer_kwargs[b][i]))
        if stop_after is not None and stop_after(b):
            del stream.chunks[b + 1 :], stream.layer_kwargs[b + 1 :]
            break
    stream.embed = None
    stream.hidden.discard()
    stream.hidden = out


# --------------------------------------------------------------------------------------------- model pieces


def skeleton_model(config, attn_implementation: str | None = None) -> PreTrainedModel:
    """The model on the meta device (no data) with its non-persistent buffers (rotary frequencies) computed as
    from_pretrained computes them (`_init_weights` of their modules) and its tied weights tied, in eval mode;
    float32; attention `attn_implementation`, else `reference_attention(config)`."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=attn_implementation or reference_attention(config)
        )
    owners = {name.rpartition(".")[0] for name, b in model.named_buffers() if b.is_meta}
    for name in owners:
        module = model.get_submodule(name)
        module.to_empty(device="cpu", recurse=False)
        model._init_weights(module)
    model.tie_weights()  # as from_pretrained does (from_config leaves e.g. Gemma 3's lm_head untied)
    return model.eval()


def source_tensors(reader: TensorReader, module: nn.Module, prefix: str, model_dir: Path) -> dict[str, torch.Tensor]:
    """module's state (relative names) from the checkpoint in float32 (as from_pretrained(dtype=float32) loads it),
    fused routed experts from their per-expert tensors (`fuse_expert_matrices`). CheckpointError names a missing
    tensor."""
    fused = fused_experts_modules(module)
    state = {}
    for name in module.state_dict(keep_vars=True):
        key = f"{prefix}{name}"
        owner, _, leaf = name.rpartition(".")
        if key in reader:
            tensor = reader[key]
        elif owner in fused and leaf in ("gate_up_proj", "down_proj"):
            continue  # below, both at once
        else:
            raise CheckpointError(f"{model_dir}: the checkpoint has no tensor {key}")
        state[name] = tensor.float() if tensor.is_floating_point() else tensor
    for name, experts in fused.items():
        num = cast(torch.Tensor, experts.gate_up_proj).shape[0]
        base = f"{prefix}{name}"
        matrices = {}
        for key in (f"{base}.{e}.{p}" for e in range(num) for p in ("gate_proj", "up_proj", "down_proj")):
            if f"{key}.weight" not in reader:
                raise CheckpointError(f"{model_dir}: the checkpoint has no tensor {key}.weight (routed expert)")
            matrices[key] = reader[f"{key}.weight"]
        gate_up, down = fuse_expert_matrices(matrices, base, num)
        state[f"{name}.gate_up_proj"], state[f"{name}.down_proj"] = gate_up.float(), down.float()
    return state


def check_weights_match_config(model_dir: str | Path) -> None:
    """The checkpoint's tensors against the model its config.json declares, before any work (both quantize paths):
    every tensor of the model present with its shape (a tied one through its partner, routed experts per expert)
    and no decoder layer beyond `num_hidden_layers`. CheckpointError names the first disagreements and the count;
    without this, transformers fills a missing layer with uninitialised memory and drops extra ones silently."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as err:  # transformers' own checks (e.g. layer_types vs num_hidden_layers), any type
        message = " ".join(str(err).split())
        raise CheckpointError(f"{model_dir / 'config.json'}: transformers rejects it: {message}") from None
    reader = open_source(model_dir, config.model_type)
    skeleton = skeleton_model(config)
    tied = tied_partners(skeleton)
    fused = fused_experts_modules(skeleton)
    missing, misshapen = [], []
    for key, value in skeleton.state_dict(keep_vars=True).items():
        owner, _, leaf = key.rpartition(".")
        if owner in fused and leaf in ("gate_up_proj", "down_proj") and key not in reader:  # stored per expert
            parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
            expected = [f"{owner}.{e}.{p}.weight" for e in range(value.shape[0]) for p in parts]
            missing += [name for name in expected if name not in reader]
            continue
        partner = tied.get(key)
        stored = key if key in reader else partner if partner is not None and partner in reader else None
        if stored is None:
            missing.append(key)
        elif (shape := reader.shape(stored)) != tuple(value.shape):
            misshapen.append(f"{key} is {shape} in the weights, {tuple(value.shape)} by config.json")
    try:
        stack, layers = decoder_stack(skeleton)
    except LayerwiseError:  # no decoder layers to count (e.g. GPT-2): the tensors above were checked
        stack, layers = "", nn.ModuleList()
    prefix = re.compile(rf"{re.escape(stack)}\.(\d+)\.")
    ignored = [re.compile(p) for p in getattr(skeleton, "_keys_to_ignore_on_load_unexpected", None) or []]
    stored_layers = {  # a multi-token-prediction layer stored past the last (DeepSeek-V3, GLM-4.5) is ignored, as
        int(m.group(1))  # transformers ignores it
        for n in reader.names
        if stack and (m := prefix.match(n)) and not any(p.search(n) for p in ignored)
    }
    extra = sorted(stored_layers - set(range(len(layers))))
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) the config declares are missing (e.g. {', '.join(missing[:3])})")
    if misshapen:
        problems.append(f"{len(misshapen)} tensor(s) of another shape (e.g. {'; '.join(misshapen[:2])})")
    if extra:
        problems.append(f"the weights hold decoder layer(s) {extra[:3]} beyond num_hidden_layers {len(layers)}")
    if problems:
        raise CheckpointError(f"{model_dir}: config.json does not match the weights: {'; '.join(problems)}")


def open_source(model_dir: str | Path, model_type: str) -> TensorReader:
    """A reader of a source checkpoint under the names of the transformers model (`stored_names`)."""
    reader = TensorReader(model_dir)
    reader.aliases.update(stored_names(model_type, reader.names))
    return reader


def stored_names(model_type: str, names: list[str]) -> dict[str, str]:
    """{name in the transformers model's layout: name stored} for the tensors `names` of a checkpoint saved in the
    layout transformers converts at load (its checkpoint conversion mapping for model_type; e.g. Mixtral's hub
    checkpoints and transformers 5's own save_pretrained: `block_sparse_moe.experts.<e>.w1.weight`): renamings
    applied, and each per-expert matrix named after its part of the fused tensor it is merged into
    (`mlp.experts.<e>.gate_proj.weight`, as `fuse_expert_matrices` reads them). Empty where nothing is renamed."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    conversions = get_checkpoint_conversion_mapping(model_type) or []
    renames = [
        (src, dst)
        for c in conversions
        if isinstance(c, WeightRenaming)
        for src, dst in zip(c.source_patterns, c.target_patterns)
    ]
    parts = {}  # stored per-expert leaf (w1) -> the fused part it is (gate_proj)
    for c in conversions:
        if not isinstance(c, WeightConverter) or len(c.target_patterns) != 1:
            continue
        target = c.target_patterns[0].rsplit(".", 1)[-1]
        leaves = [pattern.split(".*.", 1)[-1].removesuffix(".weight") for pattern in c.source_patterns]
        if target == "gate_up_proj" and len(leaves) == 2:
            parts.update({leaves[0]: "gate_proj", leaves[1]: "up_proj"})
        elif target == "down_proj" and len(leaves) == 1:
            parts[leaves[0]] = "down_proj"
    aliases = {}
    for stored in names:
        name = stored
        for src, dst in renames:
            name = name.replace(src, dst)
        owner, _, leaf = name.removesuffix(".weight").rpartition(".")
        if ".experts." in name and leaf in parts and name.endswith(".weight"):
            name = f"{owner}.{parts[leaf]}.weight"
        if name != stored:
            aliases[name] = stored
    return aliases


def materialize(module: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Give `module` (on the meta device) the tensors of `state` (strict: every one, no other); CheckpointError."""
    try:
        module.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        raise CheckpointError(f"{where}: the checkpoint's tensors do not fit the model: {err}") from err


def head_name(model: PreTrainedModel) -> str | None:
    """The module name of the model's output embeddings (lm_head), None where it has none."""
    head = model.get_output_embeddings()
    return next((name for name, module in model.named_modules() if module is head), None) if head is not None else None


def outside_state(
    reader: TensorReader, keys: list[str], tied: dict[str, str], model_dir: Path
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors `keys` (outside the decoder layers) in float32 as from_pretrained(dtype=float32) loads
    them; a key the checkpoint does not store is read from its tied partner (`tied_partners`)."""
    state = {}
    for key in keys:
        source = key if key in reader else tied.get(key)
        if source is None or source not in reader:
            raise CheckpointError(f"{model_dir}: the checkpoint has no tensor {key}")
        tensor = reader[source]
        state[key] = tensor.float() if tensor.is_floating_point() else tensor
    return state


def outside_keys(model: nn.Module) -> tuple[list[str], list[str]]:
    """(the model's state keys outside the decoder layers except its output head's, the output head's keys): what
    the forward up to the first layer needs, and what only the head needs (state-dict order)."""
    stack, _ = decoder_stack(model)
    head = head_name(model)
    outside = [k for k in model.state_dict(keep_vars=True) if not k.startswith(f"{stack}.")]
    head_keys = [k for k in outside if head is not None and k.startswith(f"{head}.")]
    return [k for k in outside if k not in head_keys], head_keys


def load_outside(model: nn.Module, reader: TensorReader, keys: list[str], tied: dict[str, str]) -> None:
    """Give `model` (on the meta device) the checkpoint tensors `keys` outside its decoder layers (`outside_state`)."""
    model.load_state_dict(outside_state(reader, keys, tied, reader.model_dir), strict=False, assign=True)


def tied_partners(model: nn.Module) -> dict[str, str]:
    """state key -> another key of the same (tied) tensor, e.g. lm_head.weight -> model.embed_tokens.weight."""
    groups: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(value), []).append(key)
    return {k: other for keys in groups.values() if len(keys) > 1 for k in keys for other in keys if other != k}


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD_BYTES = 2**20


def pin_mmap_threshold() -> None:
    """glibc: serve every allocation >= 1 MiB by mmap and give it back to the OS when freed (process-wide).

    glibc raises its mmap threshold to the size of each freed mmapped block (up to 32 MiB); the layer-sized
    tensors allocated afterwards then come from the heap, whose freed pieces are not returned, and resident memory
    drifted by 0.05-0.35 GB between identical runs (benchmarks/bench_quantize_memory.py), and a layer-by-layer
    quality run kept ~35 MB per layer of freed layers resident. No effect elsewhere than glibc."""
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        pass
