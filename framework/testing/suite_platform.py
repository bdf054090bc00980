"""Contract points of a platform: its class attributes and methods, backend candidates that
resolve, an idempotent configuration hook, sane memory queries, and greedy tokens equal to the
CPU platform's on a tiny model."""

from __future__ import annotations

import copy
from dataclasses import fields

import pytest
import torch

from tokenmill import plugins
from tokenmill.interfaces.attention import AttentionConfig
from tokenmill.interfaces.platform import OP_NAMES, Platform
from tokenmill.testing.checkpoints import engine_greedy, random_prompts, save_tiny_checkpoint


@pytest.fixture(scope="module")
def platform(tokenmill_platform: str) -> type[Platform]:
    return plugins.get_registry("platforms").load(tokenmill_platform)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("tiny_llama"))


def _available(platform) -> None:
    if not platform.is_available():
        pytest.skip(f"platform {platform.name!r} is not available on this machine")


def test_interface(platform, tokenmill_platform):
    """is a Platform subclass with typed attributes, and its op table resolves"""
    assert isinstance(platform, type) and issubclass(platform, Platform), "not a subclass of Platform"
    assert platform.name == tokenmill_platform, (
        f"name {platform.name!r} differs from its registered name {tokenmill_platform!r}"
    )
    assert isinstance(platform.device_type, str) and platform.device_type
    assert platform.supported_dtypes and all(
        isinstance(d, torch.dtype) for d in platform.supported_dtypes
    ), f"supported_dtypes must be a non-empty tuple of torch dtypes, got {platform.supported_dtypes!r}"
    assert all(isinstance(q, str) for q in platform.supported_quantization)
    assert isinstance(platform.detection_priority, int)
    assert isinstance(platform.is_available(), bool), "is_available() must return a bool"
    assert isinstance(platform.is_auto_selectable(), bool), "is_auto_selectable() must return a bool"
    for model_dtype in (torch.float32, torch.bfloat16, torch.float16):
        chosen = platform.default_dtype(model_dtype)
        assert chosen in platform.supported_dtypes, (
            f"default_dtype({model_dtype}) = {chosen}, not in supported_dtypes"
        )
    ops = platform.get_ops()
    assert set(ops) <= set(OP_NAMES) and all(callable(op) for op in ops.values())


def test_candidates_are_registered_backends(platform):
    """every attention backend it lists is registered, and one serves a plain model"""
    registry = plugins.get_registry("attention_backends")
    for dtype in platform.supported_dtypes:
        for head_size in (64, 128):
            for use_mla in (False, True):
                config = AttentionConfig(
                    head_size=head_size, dtype=dtype, use_mla=use_mla,
                    device_type=platform.device_type,
                )
                candidates = platform.get_attn_backend_candidates(config)
                unknown = [name for name in candidates if name not in registry]
                assert not unknown, (
                    f"candidates for {config} name unregistered backend(s) {unknown}; "
                    f"registered: {registry.names()}"
                )
                if not use_mla and head_size == 64:
                    assert any(
                        not registry.load(name).validate_configuration(config) for name in candidates
                    ), f"no candidate backend serves {config}: {candidates}"


def test_check_and_update_config_is_idempotent(platform, tiny_llama):
    """check_and_update_config applied twice changes nothing the second time"""
    from tokenmill.config import EngineConfig
    from tokenmill.config_resolver import resolve_config

    _available(platform)
    config = resolve_config(EngineConfig(model=str(tiny_llama), platform=platform.name, num_kv_blocks=16))
    once = {f.name: copy.copy(getattr(config, f.name)) for f in fields(config) if f.name != "hf_config"}
    platform.check_and_update_config(config)
    twice = {f.name: getattr(config, f.name) for f in fields(config) if f.name != "hf_config"}
    changed = sorted(name for name in once if once[name] != twice[name])
    assert not changed, f"a second check_and_update_config changed {changed}"


def test_memory_queries(platform, tiny_llama):
    """reports total and free memory, and a KV-cache budget that fits in the free memory"""
    from tokenmill.config import EngineConfig
    from tokenmill.config_resolver import resolve_config

    _available(platform)
    total, free = platform.get_device_total_memory(), platform.get_available_memory()
    assert isinstance(total, int) and total > 0, f"get_device_total_memory() = {total!r}"
    assert isinstance(free, int) and 0 < free <= total, f"get_available_memory() = {free!r} of {total}"
    config = resolve_config(EngineConfig(model=str(tiny_llama), platform=platform.name))
    budget = platform.get_kv_cache_budget(config)
    assert isinstance(budget, int) and 0 < budget <= free, (
        f"get_kv_cache_budget() = {budget!r} with {free} bytes free"
    )


def test_greedy_equals_cpu_platform(platform, tiny_llama):
    """generates the CPU platform's greedy tokens on a tiny Llama"""
    _available(platform)
    prompts = random_prompts(256)
    ours, _ = engine_greedy(tiny_llama, prompts, 12, platform=platform.name)
    cpu, _ = engine_greedy(tiny_llama, prompts, 12, platform="cpu")
    for i, (a, b) in enumerate(zip(ours, cpu)):
        assert a == b, f"prompt {i}: tokens {a} differ from the CPU platform's {b}"
