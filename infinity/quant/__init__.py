"""Quantization kernels shared by every user (quantized export; ZeRO++ qwZ when it lands)."""
from .blockwise import (QuantizationError, QuantizedTensor, dequantize, fake_quantize, group_scales,
                        pack_bits, qrange, quantize, unpack_bits)

__all__ = ["QuantizationError", "QuantizedTensor", "dequantize", "fake_quantize", "group_scales", "pack_bits",
           "qrange", "quantize", "unpack_bits"]
