"""Quantization kernels shared by every user (quantized export; ZeRO++ qwZ and qgZ through
:mod:`infinity.quant.kernel`, the flat fast path)."""
from .blockwise import (QuantizationError, QuantizedTensor, dequantize, fake_quantize, group_scales,
                        pack_bits, qrange, quantize, unpack_bits)

__all__ = ["QuantizationError", "QuantizedTensor", "dequantize", "fake_quantize", "group_scales", "pack_bits",
           "qrange", "quantize", "unpack_bits"]
