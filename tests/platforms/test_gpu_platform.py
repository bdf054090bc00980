"""The CUDA and ROCm platforms: their decisions with torch's CUDA queries stubbed (runs
anywhere), and detection, capabilities and memory on a real GPU (``gpu``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.config import EngineConfig
from tokenmill.interfaces.attention import AttentionConfig
from tokenmill.platforms.cpu import CpuPlatform
from tokenmill.platforms.cuda import CudaPlatform
from tokenmill.platforms.rocm import RocmPlatform
from tokenmill.selector import select_platform
from tokenmill.platforms.cpu_graph import CpuGraphRunner
from tokenmill.interfaces.decode_graph import DecodeGraphRunner
from tokenmill.platforms.cuda_graph import CudaGraphRunner

GiB = 1 << 30


@pytest.fixture
def fake_gpu(monkeypatch):
    """An NVIDIA GPU of capability 7.5 with 16 GiB, 6 GiB of them in use."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GiB, 16 * GiB))


def test_detection_follows_torch_build(fake_gpu, monkeypatch):
    assert CudaPlatform.is_available() and not RocmPlatform.is_available()
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert RocmPlatform.is_available() and not CudaPlatform.is_available()


def test_no_gpu_means_neither_platform(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not CudaPlatform.is_available() and not RocmPlatform.is_available()
    assert CudaPlatform.get_device_capability() is None


def test_bf16_needs_ampere(fake_gpu, monkeypatch):
    assert CudaPlatform.get_device_capability() == (7, 5)
    assert CudaPlatform.default_dtype(torch.bfloat16) == torch.float16
    config = EngineConfig()
    config.torch_dtype = torch.bfloat16
    with pytest.raises(ValueError, match="bfloat16 needs .* 8.0.*7.5"):
        CudaPlatform.check_and_update_config(config)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert CudaPlatform.default_dtype(torch.bfloat16) == torch.bfloat16
    assert CudaPlatform.default_dtype(torch.float32) == torch.bfloat16
    assert CudaPlatform.default_dtype(torch.float16) == torch.float16
    CudaPlatform.check_and_update_config(config)


def test_kv_cache_budget_is_utilization_minus_used(fake_gpu):
    assert CudaPlatform.get_device_total_memory() == 16 * GiB
    assert CudaPlatform.get_available_memory() == 10 * GiB
    config = EngineConfig(gpu_memory_utilization=0.5)
    assert CudaPlatform.get_kv_cache_budget(config) == 2 * GiB
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        CudaPlatform.get_kv_cache_budget(EngineConfig(gpu_memory_utilization=0.3))


def test_gpu_memory_utilization_is_checked():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_backend_priorities():
    config = AttentionConfig(head_size=128, dtype=torch.bfloat16, device_type="cuda")
    assert CudaPlatform.get_attn_backend_candidates(config) == [
        "flash_attn",
        "flashinfer",
        "triton",
        "torch",
    ]
    assert RocmPlatform.get_attn_backend_candidates(config) == ["triton", "torch"]



class _CapturableBuilder:
    def build_for_graph(self, common):
        return None

    def update_for_graph(self, metadata, common):
        pass


@pytest.mark.parametrize(
    "platform, enforce_eager, runner_cls",
    [
        (CudaPlatform, False, CudaGraphRunner),
        (RocmPlatform, False, CudaGraphRunner),
        (CudaPlatform, True, None),
        (CpuPlatform, False, CpuGraphRunner),
        (CpuPlatform, True, None),
    ],
)
def test_decode_graphs_are_the_platforms_decision(monkeypatch, platform, enforce_eager, runner_cls):
    """The platform names the kind of decode graphs, not the device's type (capture is stubbed
    to one size: the device here is the CPU)."""
    for cls in (CudaGraphRunner, CpuGraphRunner):
        monkeypatch.setattr(cls, "capture", lambda self: self.graphs.update({1: None}))
    config = EngineConfig(enforce_eager=enforce_eager, max_model_len=64)
    config.platform_cls = platform
    runner = DecodeGraphRunner.create(config, nn.Identity(), _CapturableBuilder(), 4, torch.device("cpu"))
    assert (runner and type(runner)) is runner_cls


def test_gpu_platforms_op_table_is_the_triton_kernels():
    """Their layers run ``forward_native`` (torch's CUDA ops); MoE experts run the Triton
    fused-MoE kernel and LoRA layers the Triton LoRA kernel, the platforms' two ops."""
    from tokenmill.platforms.cuda_fused_moe import TritonFusedMoEMethod
    from tokenmill.platforms.cuda_lora import lora_apply

    assert CudaPlatform.get_ops() == RocmPlatform.get_ops() == {
        "unquantized_fused_moe": TritonFusedMoEMethod,
        "lora_apply": lora_apply,
    }


@pytest.mark.gpu
def test_real_gpu_is_detected():
    platform = select_platform()
    expected = RocmPlatform if torch.version.hip else CudaPlatform
    assert platform is expected
    assert platform.device_type == "cuda"
    major, minor = platform.get_device_capability()
    assert major >= 5 and minor >= 0
    assert torch.float16 in platform.supported_dtypes
    assert platform.device(0) == torch.device("cuda", 0)
    total = platform.get_device_total_memory()
    assert 0 < platform.get_available_memory() <= total
    budget = platform.get_kv_cache_budget(EngineConfig(gpu_memory_utilization=0.9))
    assert 0 < budget <= 0.9 * total


@pytest.mark.gpu
def test_default_backend_on_gpu_is_a_gpu_backend():
    from tokenmill.selector import select_attention_backend

    platform = select_platform()
    dtype = torch.bfloat16 if platform.supports_bf16() else torch.float16
    config = AttentionConfig(head_size=64, dtype=dtype, device_type="cuda")
    backend = select_attention_backend(platform, config)
    assert backend.get_name() in ("flash_attn", "flashinfer", "triton")
