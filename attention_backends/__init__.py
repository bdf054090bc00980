"""First-party attention backends, registered through the ``tokenmill.plugins`` entry point."""

from tokenmill.plugins import hookimpl


@hookimpl
def register_attention_backends(register):
    register("torch", "tokenmill.attention_backends.torch_ref:TorchRefBackend")
    register("cpu_sdpa", "tokenmill.attention_backends.cpu_sdpa:CpuSdpaBackend")
    register("triton", "tokenmill.attention_backends.triton_attn:TritonAttentionBackend")
    register("flash_attn", "tokenmill.attention_backends.flash_attn:FlashAttentionBackend")
    register("flashinfer", "tokenmill.attention_backends.flashinfer:FlashInferBackend")
    register("torch_mla", "tokenmill.attention_backends.torch_mla:TorchMLABackend")
    register("cpu_mla", "tokenmill.attention_backends.cpu_mla:CpuMLABackend")
    register("triton_mla", "tokenmill.attention_backends.triton_mla:TritonMLABackend")
