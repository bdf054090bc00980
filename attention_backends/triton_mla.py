"""Triton MLA backend: the reference MLA backend with its decode in a Triton kernel
(``triton_mla_kernels``).

Same latent layout and metadata as ``torch_mla``; prefill chunks decompress through
``kv_b_proj`` in torch, decodes run the absorbed attention over the paged latents in one kernel
launch for the whole decode batch. Runs on CUDA and ROCm, and on the CPU under
``TRITON_INTERPRET=1`` (for tests).
"""

from __future__ import annotations

import torch

from tokenmill.attention_backends.torch_mla import TorchMLABackend, TorchMLAImpl
from tokenmill.attention_backends.torch_ref import TorchRefMetadata
from tokenmill.attention_backends.triton_attn import triton_reasons
from tokenmill.interfaces.attention import AttentionConfig, AttentionImpl

MAX_LATENT_SIZE = 1024


class TritonMLAImpl(TorchMLAImpl):
    def decode(self, q: torch.Tensor, cache: torch.Tensor, md: TorchRefMetadata) -> torch.Tensor:
        from tokenmill.attention_backends.triton_mla_kernels import mla_decode

        assert md.decode_slots is not None and md.decode_pos is not None
        o_lat = mla_decode(
            self.absorb_query(q).contiguous(),
            cache,
            md.decode_slots,
            (md.decode_pos + 1).to(torch.int32),
            self.kv_lora_rank,
            self.scale,
        )
        return self.absorb_output(o_lat)


class TritonMLABackend(TorchMLABackend):
    supported_kv_cache_dtypes = ("auto",)

    @staticmethod
    def get_name() -> str:
        return "triton_mla"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonMLAImpl

    @classmethod
    def validate_configuration(cls, config: AttentionConfig) -> list[str]:
        reasons = super().validate_configuration(config) + triton_reasons(config)
        if config.head_size > MAX_LATENT_SIZE:
            reasons.append(f"latent size {config.head_size} is larger than {MAX_LATENT_SIZE}")
        return reasons
