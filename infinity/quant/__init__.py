"""Quantization kernels shared by every user (quantized export; ZeRO++ qwZ and qgZ through
:mod:`infinity.quant.kernel`, the flat fast path; QLoRA-style frozen weights through
:func:`quantize_weight`: int8, int4 and NF4 with optional double quantization)."""
from .blockwise import (QuantizationError, QuantizedTensor, dequantize, fake_quantize, group_scales,
                        pack_bits, qrange, quantize, unpack_bits)
from .nf4 import NF4_CODE, double_dequantize, double_quantize, dynamic_code
from .weight import WEIGHT_DTYPES, QuantizedWeight, quantize_weight

__all__ = ["QuantizationError", "QuantizedTensor", "dequantize", "fake_quantize", "group_scales", "pack_bits",
           "qrange", "quantize", "unpack_bits", "NF4_CODE", "double_quantize", "double_dequantize",
           "dynamic_code", "QuantizedWeight", "quantize_weight", "WEIGHT_DTYPES"]
