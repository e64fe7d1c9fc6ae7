"""Calibration before quantization: SmoothQuant (paper 000 App. A.4.2; Xiao et al. 2023).

- `mappings`: which smoothing layer feeds which linears, per architecture and variant flag, and how a
  factor folds into each kind of layer (RMSNorm, PreAffine, DyT, GatedNorm, v_proj, up_proj).
- `stats`: calibration windows from a local corpus and per-channel max |x| at the consumers' input.
- `smoothquant`: the factors, the folds, the function-preservation check and the report.
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
from quantkit.calibrate.stats import calibration_batches, channel_max, heldout_texts

__all__ = [
    "FunctionPreservationError", "MappingPlan", "MappingReport", "NonFiniteStatisticsError", "SmoothMapping",
    "SmoothQuantMappingError", "SmoothQuantReport", "calibration_batches", "channel_max", "heldout_texts",
    "resolve_mappings", "smooth_model", "smoothing_factors",
]
