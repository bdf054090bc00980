"""Quantization methods (GGUF blocks, FP8 and INT8 weights, FP8 KV cache).

Methods implement ``tokenmill.interfaces.QuantizationMethod`` and are registered through the
``register_quantization_methods`` hook of a ``tokenmill.plugins`` entry point.
"""

from tokenmill.plugins import hookimpl


@hookimpl
def register_quantization_methods(register):
    register("gguf", "tokenmill.quant.gguf:GGUFConfig")
