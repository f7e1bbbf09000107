"""Block-wise symmetric quantizers for ZeRO++ (qwZ int8 weights, qgZ int4 gradients).

``quantize`` / ``dequantize`` and qgZ's reduction steps ``dequantize_sum`` / ``dequantize_sum_quantize`` run the
Triton kernels for CUDA tensors, the C kernel for CPU tensors, and the executable specification
(``blockwise.py``) otherwise (``dispatch.py`` says when); all give bit-identical results. The spec is also
exported as ``*_reference`` for tests and debugging.
"""

from .blockwise import QMAX, NonFiniteInputError, QuantizedRows
from .blockwise import dequantize as dequantize_reference
from .blockwise import dequantize_sum as dequantize_sum_reference
from .blockwise import dequantize_sum_quantize as dequantize_sum_quantize_reference
from .blockwise import quantize as quantize_reference
from .dispatch import dequantize, dequantize_sum, dequantize_sum_quantize, quantize, triton_available
from .fast import fast_available
from .layout import BlockLayout, payload_bytes

__all__ = [
    "QMAX",
    "BlockLayout",
    "NonFiniteInputError",
    "QuantizedRows",
    "dequantize",
    "dequantize_reference",
    "dequantize_sum",
    "dequantize_sum_quantize",
    "dequantize_sum_quantize_reference",
    "dequantize_sum_reference",
    "fast_available",
    "payload_bytes",
    "quantize",
    "quantize_reference",
    "triton_available",
]
