"""Built-in schemes; importing this package registers them (each module's decorators run on import)."""

from ascent.quantization.schemes import (  # noqa: F401
    a310p,
    fp8_dynamic,
    moe_w4a8,
    moe_w4a16,
    moe_w8a8_dynamic,
    w4a8,
    w4a16,
    w8a8_dynamic,
    w8a8_mix,
    w8a8_static,
    w8a16,
)
