"""310P scheme registry (spec §6): W8A8 static (int64 deq_scale), W8A8_DYNAMIC (symmetric only), W8A8S (dense int8
weight with many zeros, run exactly like W8A8 static) and W8A8SC (rejected: a 310P-only compressed layout with no
public decoder). The math is the default schemes'; these subclasses only register them in the 310P table."""

from __future__ import annotations

from ascent.quantization.base import QuantSpec
from ascent.quantization.registry import register_scheme_310p
from ascent.quantization.schemes.moe_w8a8_dynamic import W8A8DynamicMoE
from ascent.quantization.schemes.w8a8_dynamic import W8A8DynamicLinear
from ascent.quantization.schemes.w8a8_static import W8A8StaticLinear

W8A8SC_MESSAGE = "W8A8SC is a 310P-only compressed format; re-export as W8A8S/W8A8"


@register_scheme_310p("W8A8", "linear")
class W8A8StaticLinear310P(W8A8StaticLinear):
    """310P W8A8 static; the deq_scale loader accepts the int64 (fp32 bits) encoding 310P exports always use."""


@register_scheme_310p("W8A8_DYNAMIC", "linear")
class W8A8DynamicLinear310P(W8A8DynamicLinear):
    """310P W8A8 dynamic; symmetric only (a non-zero ``weight_offset`` is a ValueError at load)."""


@register_scheme_310p("W8A8_DYNAMIC", "moe")
class W8A8DynamicMoE310P(W8A8DynamicMoE):
    """310P W8A8 dynamic experts (fp32 per-channel scales)."""


@register_scheme_310p("W8A8S", "linear")
class W8A8SparseLinear310P(W8A8StaticLinear):
    """msmodelslim sparse-quant output: a dense int8 weight with many zeros, W8A8 static math."""


@register_scheme_310p("W8A8SC", "linear")
class W8A8SparseCompressedLinear310P(W8A8StaticLinear):
    """Rejected at construction: its compressed weight stream has no public decoder."""

    def __init__(self, spec: QuantSpec) -> None:
        raise ValueError(W8A8SC_MESSAGE)
