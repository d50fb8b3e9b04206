"""Pure-torch fp32 references: the oracle for every kernel and the CPU execution path's ground truth."""

from kda_backend.reference.layer import KDALayerWeights, reference_kda_layer
from kda_backend.reference.projection import reference_projection, reference_projection_packed, split_packed
from kda_backend.reference.recurrence import recurrence_chunked, recurrence_token_loop

__all__ = [
    "KDALayerWeights",
    "recurrence_chunked",
    "recurrence_token_loop",
    "reference_kda_layer",
    "reference_projection",
    "reference_projection_packed",
    "split_packed",
]
