"""The transformers side of the variant family: config validation, exact save/load, each flag's formula."""

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from quantkit.models import QuantkitConfig, QuantkitForCausalLM
from quantkit.models.modeling import QuantkitAttention, QuantkitNorm, value_scale
from quantkit.models.tiny import TINY_SHAPE, build_tiny_checkpoint, randomize_parameters

VARIANTS = {
    "baseline": {},
    "ga_headwise": dict(attn_output_gate="headwise"),
    "ga_elementwise": dict(attn_output_gate="elementwise"),
    "ga_preaffine": dict(attn_output_gate="headwise", pre_affine=True),
    "ga_gatednorm": dict(attn_output_gate="headwise", gated_norm_rank=16),
    "glu": dict(hidden_act="sigmoid"),
    "dyt": dict(norm_type="dyt"),
    "gated_dyt": dict(norm_type="dyt", gated_norm_rank=16),
    "v_scale": dict(value_scale=True),
    "headwise_rmsnorm": dict(headwise_rmsnorm=True),
    "attention_sink": dict(attention_sink=True),
}


def _config(**flags) -> QuantkitConfig:
    return QuantkitConfig(**{"vocab_size": 300, "bos_token_id": 0, **TINY_SHAPE, **flags})


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(attn_output_gate="channelwise"), "attn_output_gate"),
        (dict(norm_type="layernorm"), "norm_type"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(gated_norm_rank=-1), "gated_norm_rank"),
        (dict(norm_type="dyt", pre_affine=True), "pre_affine"),
        (dict(gated_attention=True), "unknown config key"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(head_dim=63), "head_dim"),
    ],
)
def test_bad_configs_name_the_problem(flags, message):
    # transformers' own validators (e.g. RoPE's even head_dim) raise StrictDataclassClassValidationError
    with pytest.raises((ValueError, StrictDataclassClassValidationError), match=message):
        _config(**flags)


@pytest.mark.parametrize("name", ["ga_gatednorm", "gated_dyt", "attention_sink"])
def test_save_load_round_trip_is_exact(name, tmp_path):
    path = build_tiny_checkpoint(tmp_path / name, **VARIANTS[name])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert (
        isinstance(model, QuantkitForCausalLM) and model.config.variant_name == _config(**VARIANTS[name]).variant_name
    )
    saved = load_file(path / "model.safetensors")
    state = model.state_dict()
    assert set(saved) == set(state)
    assert all(torch.equal(state[k], v) for k, v in saved.items())


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "baseline"])
def test_every_flag_changes_the_function(name):
    """The flag's own parameters at random values move the logits away from the same model without it."""
    torch.manual_seed(0)
    with_flag = QuantkitForCausalLM(_config(**VARIANTS[name]))
    randomize_parameters(with_flag, 0.05)
    without = QuantkitForCausalLM(_config())
    missing, _unexpected = without.load_state_dict(with_flag.state_dict(), strict=False)[:2]
    assert not missing  # the baseline's parameters are a subset of every variant's
    ids = torch.randint(1, 300, (1, 12))
    ids[0, 0] = 0  # BOS at position 0
    with torch.no_grad():
        gap = (with_flag(ids).logits - without(ids).logits).abs().max().item()
    # an active flag moves logits by O(1) (0.5 .. 4.8 over seeds 0-3 for every flag), float32 noise by ~1e-6
    assert gap > 1e-2, f"{name}: flag has no effect (max |logit diff| {gap:.1e})"


def test_attention_sink_refuses_a_sequence_without_bos():
    model = QuantkitForCausalLM(_config(attention_sink=True))
    with pytest.raises(ValueError, match="BOS token"):
        model(torch.tensor([[5, 6, 7]]))
    model(torch.tensor([[0, 6, 7]]))


def test_gated_norm_formula():
    norm = QuantkitNorm(_config(gated_norm_rank=4))
    torch.manual_seed(0)  # the data must not depend on which tests ran before
    randomize_parameters(norm, 0.3)
    x = torch.randn(3, 256)
    y = norm.weight * (x / x.pow(2).mean(-1, keepdim=True).add(norm.eps).sqrt())
    expected = torch.sigmoid(norm.gate_up.weight @ torch.nn.functional.silu(norm.gate_down.weight @ y.T)).T * y
    # float32 order only: RMS over D = 256 positive terms is within gamma_D ~ D u = 1.5e-5 (worst case, any
    # order; half after sqrt), the rank-4 gate's logits carry ~sqrt(D) u |W||y| ~ 1e-6 typical, damped by
    # sigmoid' <= 1/4: rtol 1e-5 + atol 1e-6 covers the typical case ~10x; a wrong formula moves O(1e-1)
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-6)


def test_pre_affine_and_dyt_formulas():
    torch.manual_seed(0)  # the data must not depend on which tests ran before
    pre = QuantkitNorm(_config(pre_affine=True))
    randomize_parameters(pre, 0.3)
    x = torch.randn(3, 256)
    h = pre.pre_scale * x
    torch.testing.assert_close(pre(x), pre.weight * h / h.pow(2).mean(-1, keepdim=True).add(pre.eps).sqrt())
    dyt = QuantkitNorm(_config(norm_type="dyt"))
    randomize_parameters(dyt, 0.3)
    torch.testing.assert_close(dyt(x), dyt.weight * torch.tanh(dyt.alpha * x) + dyt.bias)


def test_value_scale_formula():
    v = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    theta = torch.tensor([0.3, -1.0])[:, None, None]
    r = (v**2).sum(-1, keepdim=True)
    torch.testing.assert_close(value_scale(v, theta, 64), v * r / (r + (64 * 0.02) ** 2 * torch.exp(theta)))


def _attention(config: QuantkitConfig) -> QuantkitAttention:
    attn = QuantkitAttention(config, 0)
    randomize_parameters(attn, 0.05)
    attn.config._attn_implementation = "eager"
    return attn


def _rope(config, t):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    pos = torch.arange(t)[None]
    return Qwen3RotaryEmbedding(config)(torch.zeros(1, t, 1), pos), pos


def test_attention_sink_equals_softmax_over_keys_plus_sink():
    """Paper 004 (d): o_t = softmax([q k_1..k_t, q k']) [v_1..v_t; v'] for the tokens after BOS."""
    config = _config(attention_sink=True)
    attn = _attention(config)
    t = 6
    x = torch.randn(1, t, config.hidden_size, generator=torch.Generator().manual_seed(0))
    (cos, sin), pos = _rope(config, t)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    got = attn(x, (cos, sin), mask, position_ids=pos)[0]

    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    d, h, kvh = attn.head_dim, config.num_attention_heads, config.num_key_value_heads
    q = attn.q_norm(attn.q_proj(x).view(1, t, h, d)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x).view(1, t, kvh, d)).transpose(1, 2)
    v = attn.v_proj(x).view(1, t, kvh, d).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k = torch.cat([attn.sink_key[None, :, None], k[:, :, 1:]], 2).repeat_interleave(h // kvh, 1)
    v = torch.cat([attn.sink_value[None, :, None], v[:, :, 1:]], 2).repeat_interleave(h // kvh, 1)
    o = torch.softmax(q @ k.transpose(-1, -2) * d**-0.5 + mask, -1) @ v  # index 0 of k, v is the sink
    expected = attn.o_proj(o.transpose(1, 2).reshape(1, t, -1))
    torch.testing.assert_close(got[:, 1:], expected[:, 1:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_output_gate_and_headwise_rmsnorm(gate):
    """Zero gate weights halve the head outputs (sigmoid(0) = 1/2); head-wise RMSNorm gives unit-RMS heads."""
    config = _config(attn_output_gate=gate, headwise_rmsnorm=True)
    attn = _attention(config)
    t = 5
    x = torch.randn(1, t, config.hidden_size, generator=torch.Generator().manual_seed(0))
    rope, pos = _rope(config, t)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    captured = {}
    attn.o_proj.register_forward_pre_hook(lambda m, a: captured.setdefault("o", a[0]))
    with torch.no_grad():
        attn.g_proj.weight.zero_()
        attn.o_norm.weight.fill_(2.0)
    attn(x, rope, mask, position_ids=pos)
    heads = captured["o"].view(1, t, config.num_attention_heads, -1)
    torch.testing.assert_close(
        heads.pow(2).mean(-1).sqrt(), torch.full((1, t, config.num_attention_heads), 1.0), rtol=1e-4, atol=1e-4
    )
