"""Settings whose feature has not landed are refused when the engine is built, never ignored."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from conftest import make_tiny_checkpoint
from tokenmill import LLM, plugins
from tokenmill.config import EngineConfig
from tokenmill.config_resolver import resolve_config
from tokenmill.interfaces.quantization import QuantizationMethod
from tokenmill.platforms.cpu import CpuPlatform


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture
def fake_quant(monkeypatch) -> Iterator[str]:
    """A quantization method registered at run time, forgotten afterwards."""
    monkeypatch.setattr(plugins, "_runtime", [])
    plugins.register_quantization_method("fake-quant", "test_refused_settings:FakeQuant")
    yield "fake-quant"
    monkeypatch.undo()
    plugins.reload_plugins()


class FakeQuant(QuantizationMethod):
    @classmethod
    def supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16]

    def get_linear_method(self, layer, prefix):
        return None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"pipeline_parallel_size": 2, "enable_lora": True},
            r"pipeline parallelism with enable_lora is not implemented yet \(pipeline_parallel_size=2\)",
        ),
    ],
)
def test_unimplemented_features_are_refused(tiny_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny_dir, **kwargs)


def test_quantization_without_any_method_is_refused(tiny_dir, monkeypatch):
    monkeypatch.setenv("TOKENMILL_PLUGINS", "platforms,attention_backends,models")
    plugins.reload_plugins()
    try:
        with pytest.raises(ValueError, match=r"quantization='fp8': no quantization method is registered \(TOKENMILL_PLUGINS="):
            LLM(model=tiny_dir, quantization="fp8")
    finally:
        monkeypatch.undo()
        plugins.reload_plugins()


def test_checkpoint_naming_an_unregistered_method_is_refused(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"the checkpoint's quantization_config names quantization method 'bitsandbytes', "
        r"which is not registered; registered: awq, .*int8, w8a8",
    ):
        LLM(model=path)
    with pytest.raises(ValueError, match=r"the checkpoint is quantized with 'bitsandbytes'; quantization='int8' cannot load it"):
        LLM(model=path, quantization="int8")


def test_quantization_method_is_checked_against_registry_and_platform(tiny_dir, fake_quant, monkeypatch):
    with pytest.raises(ValueError, match=r"quantization method 'other' is not registered; registered: .*fake-quant"):
        resolve_config(EngineConfig(model=tiny_dir, quantization="other"))
    with pytest.raises(ValueError, match=r"quantization 'fake-quant' computes in torch.bfloat16, not torch.float32"):
        resolve_config(EngineConfig(model=tiny_dir, quantization=fake_quant, dtype="float32"))
    assert resolve_config(EngineConfig(model=tiny_dir, quantization=fake_quant, dtype="bfloat16"))
    monkeypatch.setattr(CpuPlatform, "supported_quantization", ("awq",))
    with pytest.raises(ValueError, match=r"platform 'cpu' does not run quantization 'fake-quant'; it runs: awq"):
        resolve_config(EngineConfig(model=tiny_dir, quantization=fake_quant, dtype="bfloat16"))


def test_gpu_memory_utilization_is_refused_on_the_cpu(tiny_dir):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization applies to GPU platforms only"):
        LLM(model=tiny_dir, platform="cpu", gpu_memory_utilization=0.5)
