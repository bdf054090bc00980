"""Quantization methods: GGUF blocks (Q4_0/Q4_1/Q8_0 kept as stored), INT8 (weight-only and
W8A8), group-wise INT4 (online, GPTQ and AWQ checkpoints) and FP8 weights (online, FP8 and
compressed-tensors checkpoints).

Methods implement ``tokenmill.interfaces.QuantizationMethod`` and are registered through the
``register_quantization_methods`` hook of a ``tokenmill.plugins`` entry point; the names are
vLLM's where vLLM has the format (``fp8``, ``gptq``, ``awq``, ``compressed-tensors``).
"""

from tokenmill.plugins import hookimpl


@hookimpl
def register_quantization_methods(register):
    register("gguf", "tokenmill.quant.gguf:GGUFConfig")
    register("int8", "tokenmill.quant.int8:Int8Config")
    register("w8a8", "tokenmill.quant.int8:W8A8Int8Config")
    register("int4", "tokenmill.quant.int4:Int4Config")
    register("gptq", "tokenmill.quant.int4:GPTQConfig")
    register("awq", "tokenmill.quant.int4:AWQConfig")
    register("fp8", "tokenmill.quant.fp8:Fp8Config")
    register("compressed-tensors", "tokenmill.quant.compressed_tensors:CompressedTensorsConfig")
