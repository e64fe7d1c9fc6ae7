"""Calibration before quantization: SmoothQuant (paper 000 App. A.4.2; Xiao et al. 2023).

- `mappings`: which smoothing layer feeds which linears, per architecture and variant flag, and how a
  factor folds into each kind of layer (RMSNorm, PreAffine, DyT, GatedNorm, v_proj, up_proj).
- `stats`: per-channel max |x| at the consumers' input over calibration windows (`quantkit.data`), and when
  those maxima count as settled (`EarlyStop`).
- `layers`: the layer-by-layer engine (a skeleton on the meta device, token windows carried layer to layer).
- `smoothquant`: the factors (`layer_factors`, one decoder layer at a time on that engine), the folds, the
  function-preservation check and the report.
"""

from quantkit.calibrate.mappings import MappingPlan, SmoothMapping, SmoothQuantMappingError, resolve_mappings
from quantkit.calibrate.smoothquant import (
    FunctionPreservationError,
    MappingReport,
    NonFiniteStatisticsError,
    SmoothQuantReport,
    smooth_model,
    smoothing_factors,
)
from quantkit.calibrate.stats import channel_max

__all__ = [
    "FunctionPreservationError",
    "MappingPlan",
    "MappingReport",
    "NonFiniteStatisticsError",
    "SmoothMapping",
    "SmoothQuantMappingError",
    "SmoothQuantReport",
    "channel_max",
    "resolve_mappings",
    "smooth_model",
    "smoothing_factors",
]
