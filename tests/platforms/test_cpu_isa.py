"""TOKENMILL_CPU_ISA: the instruction set the C kernels are built for, and the OpenMP defaults
tokenmill sets on import."""

from __future__ import annotations

import os

import pytest
import torch

from tokenmill import env_override
from tokenmill.layers.activation import SiluAndMul
from tokenmill.ops import cpu as cpu_ops
from tokenmill.platforms.cpu import CpuPlatform


@pytest.fixture
def fresh_load(tmp_path, monkeypatch):
    """``cpu_ops.load`` with an empty cache directory and its per-process cache emptied."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    cpu_ops.load.cache_clear()
    yield cpu_ops.load
    cpu_ops.load.cache_clear()


def test_avx2_build_is_cached_apart_and_matches_torch(fresh_load, tmp_path, monkeypatch):
    assert fresh_load() is not None
    monkeypatch.setenv("TOKENMILL_CPU_ISA", "avx2")
    fresh_load.cache_clear()
    assert fresh_load() is not None
    assert len(list((tmp_path / "kernels").glob("cpu_kernels_*.so"))) == 2
    x = torch.randn(7, 2 * 45)
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), SiluAndMul().forward_native(x))


def test_isa_flags():
    assert cpu_ops.ISA_FLAGS["avx2"][0] == ["-mavx2", "-mfma", "-mf16c"]
    assert cpu_ops.ISA_FLAGS["native"][0] == ["-march=native"]


@pytest.mark.parametrize("isa", ["avx3", "sse"])
def test_unknown_isa_is_refused(fresh_load, monkeypatch, isa):
    monkeypatch.setenv("TOKENMILL_CPU_ISA", isa)
    with pytest.raises(ValueError, match=f"TOKENMILL_CPU_ISA='{isa}' is not one of native, avx2, avx512"):
        fresh_load()


def test_isa_the_cpu_lacks_is_refused(fresh_load, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CPU_ISA", "avx512")
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f"})
    with pytest.raises(ValueError, match="this CPU lacks avx512vl, avx512dq, avx512bw"):
        fresh_load()


def test_a_build_without_avx2_fails_to_torch_ops(fresh_load, monkeypatch):
    monkeypatch.setitem(cpu_ops.ISA_FLAGS, "native", (["-mno-avx2"], ()))
    assert fresh_load() is None
    assert CpuPlatform.get_ops() == {}


@pytest.mark.parametrize(
    "isa,flags,dtype",
    [
        ("native", {"avx512_bf16"}, torch.bfloat16),
        ("native", {"amx_bf16"}, torch.bfloat16),
        ("native", {"avx2"}, torch.float32),
        ("avx2", {"avx512_bf16", "amx_bf16"}, torch.float32),
    ],
)
def test_avx2_keeps_float32_on_a_bf16_cpu(monkeypatch, isa, flags, dtype):
    monkeypatch.setenv("TOKENMILL_CPU_ISA", isa)
    monkeypatch.setattr(cpu_ops, "cpu_flags", lambda: flags)
    assert CpuPlatform.default_dtype(torch.bfloat16) == dtype
    assert CpuPlatform.default_dtype(torch.float32) == torch.float32


@pytest.mark.parametrize(
    "preset,expected",
    [({}, "30000"), ({"GOMP_SPINCOUNT": "5"}, "5"), ({"OMP_WAIT_POLICY": "ACTIVE"}, None)],
)
def test_openmp_spin_default(monkeypatch, preset, expected):
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in preset.items():
        monkeypatch.setenv(name, value)
    env_override.apply()
    assert os.environ.get("GOMP_SPINCOUNT") == expected
