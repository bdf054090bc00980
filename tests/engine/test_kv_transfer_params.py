"""``kv_transfer_params`` on a request: vLLM's ``SamplingParams.extra_args`` carries them to
the engine, which refuses them without a KV connector."""

import pytest

from tokenmill.sampling_params import SamplingParams


def test_extra_args_carry_kv_transfer_params_and_nothing_else():
    params = SamplingParams(extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    assert params.kv_transfer_params == {"do_remote_decode": True}
    assert SamplingParams().kv_transfer_params is None
    with pytest.raises(ValueError, match="extra_args has key\\(s\\) 'seed_offset'"):
        SamplingParams(extra_args={"seed_offset": 1})
    with pytest.raises(ValueError, match="kv_transfer_params must be a dict"):
        SamplingParams(extra_args={"kv_transfer_params": [1]})
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args=[("kv_transfer_params", {})])
