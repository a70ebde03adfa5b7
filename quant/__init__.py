"""OCP Microscaling (MX) quantization: FP6/FP4/INT8 block codes, E8M0 scales, 6- and 4-bit packing."""

from quant.mx import (
    FORMATS,
    ROUNDINGS,
    MXTensor,
    dequantize,
    element_values,
    fake_quantize,
    quantize,
)
from quant.packing import pack_fp4, pack_fp6, packed_fp6_size, unpack_fp4, unpack_fp6

__all__ = [
    "FORMATS",
    "ROUNDINGS",
    "MXTensor",
    "dequantize",
    "element_values",
    "fake_quantize",
    "pack_fp4",
    "pack_fp6",
    "packed_fp6_size",
    "quantize",
    "unpack_fp4",
    "unpack_fp6",
]
