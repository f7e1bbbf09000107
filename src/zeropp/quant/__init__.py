"""Block-wise symmetric quantizers for ZeRO++ (qwZ int8 weights, qgZ int4 gradients).

``quantize`` / ``dequantize`` dispatch to the fast C kernel (``fast.py``) for CPU tensors when it is available,
else to the executable specification (``blockwise.py``); both give bit-identical results. The spec is also
exported as ``quantize_reference`` / ``dequantize_reference`` for tests and debugging.
"""

from .blockwise import QMAX, NonFiniteInputError, QuantizedRows
from .blockwise import dequantize as dequantize_reference
from .blockwise import quantize as quantize_reference
from .fast import dequantize, fast_available, quantize
from .layout import BlockLayout, payload_bytes

__all__ = [
    "QMAX",
    "BlockLayout",
    "NonFiniteInputError",
    "QuantizedRows",
    "dequantize",
    "dequantize_reference",
    "fast_available",
    "payload_bytes",
    "quantize",
    "quantize_reference",
]
