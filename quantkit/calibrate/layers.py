"""A causal LM's forward in pieces: its decoder stack, the hidden states after the last layer, and its head.

The calibration engines (SmoothQuant's whole-model check, the streaming quantizer) compare logits without
holding vocabulary-sized tensors for whole windows: they keep the last decoder layer's output (B, T, hidden) and
apply the model's own final norm and head to HEAD_POSITIONS positions at a time (`head_logits`): (B, 64, V) float32,
~40 MB per window at V = 152k instead of ~0.3 GB. Both paths cut the same pieces, so they compute the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

HEAD_POSITIONS = 64  # positions per head_logits call


class StopForward(Exception):
    """Raised inside a model's forward to end it early, carrying the hidden states (B, T, hidden) reached."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("stop after the last decoder layer")
        self.hidden = hidden


def find_decoder_stack(model: nn.Module) -> nn.ModuleList | None:
    """model.model.layers (every transformers decoder and quantkit's families), or None where the model has none."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) > 0 else None


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
