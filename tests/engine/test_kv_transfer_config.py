"""``kv_transfer_config``: vLLM's keys from LLM(...) (a dict or a KVTransferConfig) and the CLI,
checked, and the connector chosen by name from the registry."""

from __future__ import annotations

import argparse

import pytest

from conftest import make_tiny_checkpoint
from tokenmill import cli, plugins
from tokenmill.config import EngineConfig
from tokenmill.config_resolver import resolve_config
from tokenmill.kv_transfer_config import KVTransferConfig


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


def test_dict_and_dataclass_give_the_same_config():
    raw = {"kv_connector": "storage", "kv_role": "kv_consumer", "kv_connector_extra_config": {"a": 1}}
    from_dict = EngineConfig.from_kwargs(kv_transfer_config=raw).kv_transfer
    from_class = EngineConfig.from_kwargs(kv_transfer_config=KVTransferConfig(**raw)).kv_transfer
    assert from_dict == from_class == KVTransferConfig("storage", "kv_consumer", {"a": 1})
    assert from_dict.is_kv_consumer and not from_dict.is_kv_producer
    assert KVTransferConfig("x").is_kv_producer and KVTransferConfig("x").is_kv_consumer


def test_cli_flag_takes_json():
    parser = argparse.ArgumentParser()
    cli.add_engine_args(parser)
    args = parser.parse_args(["--kv-transfer-config", '{"kv_connector": "offload"}'])
    config = EngineConfig.from_kwargs(**cli.engine_kwargs(args))
    assert config.kv_transfer == KVTransferConfig("offload")


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"kv_role": "kv_both"}, r"needs 'kv_connector'"),
        ({"kv_connector": "x", "kv_rol": "kv_both"}, r"unknown key\(s\) 'kv_rol'"),
        ({"kv_connector": "x", "kv_role": "producer"}, r"\['kv_role'\] must be one of"),
        ({"kv_connector": "x", "kv_connector_extra_config": []}, r"kv_connector_extra_config"),
    ],
)
def test_bad_keys_are_named(raw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(kv_transfer_config=raw)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}, "tensor_parallel_size=2"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative_config"),
        ({"enable_prefix_caching": False}, "enable_prefix_caching=True"),
    ],
)
def test_unsupported_combinations_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(kv_transfer_config={"kv_connector": "x"}, **kwargs)


def test_unknown_connector_names_the_registered_ones(tiny_dir):
    config = EngineConfig.from_kwargs(model=tiny_dir, kv_transfer_config={"kv_connector": "nope"})
    known = ", ".join(plugins.get_registry("kv_connectors").names()) or "none"
    with pytest.raises(ValueError, match=rf"'nope' is not a registered KV connector; registered: {known}"):
        resolve_config(config)
