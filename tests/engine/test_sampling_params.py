import numpy as np
import pytest

from tokenmill.sampling_params import (
    ALL_LOGPROBS,
    MAX_LOGPROBS,
    SamplingParams,
    SamplingType,
    num_top_logprobs,
)


def test_defaults_match_the_design():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, [], [])
    assert (p.ignore_eos, p.logprobs, p.skip_special_tokens) == (False, None, True)
    assert p.include_stop_str_in_output is False
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 1.5),
        ("n", "2"),
        ("temperature", -1),
        ("temperature", "0.5"),
        ("temperature", float("nan")),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", "1"),
        ("top_k", -2),
        ("top_k", 2.0),
        ("top_k", "5"),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("min_p", None),
        ("seed", 1.0),
        ("seed", "7"),
        ("seed", 2**64),
        ("max_tokens", 0),
        ("max_tokens", "16"),
        ("min_tokens", -1),
        ("min_tokens", 17),
        ("logprobs", -2),
        ("logprobs", MAX_LOGPROBS + 1),
        ("logprobs", "3"),
        ("prompt_logprobs", -2),
        ("prompt_logprobs", MAX_LOGPROBS + 1),
        ("prompt_logprobs", 2.0),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", [1]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", 3),
        ("ignore_eos", "yes"),
        ("skip_special_tokens", 1),
        ("include_stop_str_in_output", None),
    ],
)
def test_invalid_value_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 2**64),
        ("n", 2**64),
        ("min_tokens", 2**64),
        ("max_tokens", 2**64),
        ("seed", -(2**63) - 1),
        ("stop_token_ids", [5, 2**64]),
        ("allowed_token_ids", [2**64]),
    ],
)
def test_integers_beyond_64_bits_are_refused(field, value):
    """msgpack cannot carry them to the engine core (issue 36, item 11)."""
    with pytest.raises(ValueError, match=f"^{field} must .*64-bit|^{field} must fit in 64 bits"):
        SamplingParams(**{field: value})


def test_minus_one_logprobs_ask_for_the_whole_vocabulary():
    params = SamplingParams(logprobs=ALL_LOGPROBS, prompt_logprobs=ALL_LOGPROBS)
    assert params.logprobs == params.prompt_logprobs == -1
    assert num_top_logprobs(params.logprobs, 100) == 100 and num_top_logprobs(3, 100) == 3


def test_64_bit_extremes_are_accepted():
    p = SamplingParams(top_k=2**64 - 1, seed=-(2**63), stop_token_ids=[2**64 - 1])
    assert (p.top_k, p.seed, p.stop_token_ids) == (2**64 - 1, -(2**63), [2**64 - 1])


@pytest.mark.parametrize("field", ["temperature", "presence_penalty", "repetition_penalty"])
def test_numbers_too_large_for_a_float_are_refused(field):
    with pytest.raises(ValueError, match=f"^{field} must be a finite number"):
        SamplingParams(**{field: 10**400})


def test_temperature_error_message_is_explicit():
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1"):
        SamplingParams(temperature=-1)


def test_greedy_rejects_n_above_one():
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingParams(n=2, temperature=0)


def test_stop_and_stop_token_ids_are_normalised_to_lists():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(5, np.int64(7))).stop_token_ids == [5, 7]
    assert type(SamplingParams(stop_token_ids=[np.int64(7)]).stop_token_ids[0]) is int


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0


def test_max_tokens_none_allows_any_min_tokens():
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000


def test_numeric_types_are_coerced():
    p = SamplingParams(n=np.int64(2), temperature=1, top_p=np.float32(0.5), seed=np.int32(3))
    assert (type(p.n), type(p.temperature), type(p.top_p), type(p.seed)) == (int, float, float, int)


def test_greedy_ignores_truncation_settings():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.2)
    assert p.is_greedy and p.sampling_type is SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy


def test_sampling_type_seeded():
    assert SamplingParams(seed=0).sampling_type is SamplingType.RANDOM_SEED


def test_clone_is_independent():
    p = SamplingParams(stop=["x"], stop_token_ids=[1])
    c = p.clone()
    c.stop.append("y")
    c.stop_token_ids.append(2)
    assert p.stop == ["x"] and p.stop_token_ids == [1]
    assert c == SamplingParams(stop=["x", "y"], stop_token_ids=[1, 2])


def test_update_from_generation_config_adds_the_other_eos_ids():
    p = SamplingParams(stop_token_ids=[7])
    p.update_from_generation_config({"eos_token_id": [2, 9, 7]}, model_eos_token_id=2)
    assert p.stop_token_ids == [7, 9]
    single = SamplingParams()
    single.update_from_generation_config({"eos_token_id": 5})
    assert single.stop_token_ids == [5]
    ignored = SamplingParams(ignore_eos=True)
    ignored.update_from_generation_config({"eos_token_id": [2, 9]}, model_eos_token_id=2)
    assert ignored.stop_token_ids == []


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: float("inf")}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"bad_words": "foo"}, "bad_words"),
    ],
)
def test_invalid_penalties_and_biases_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_penalty_fields_normalised():
    params = SamplingParams(presence_penalty=1, logit_bias={"7": 2, 3: -1.5}, repetition_penalty=1.1)
    assert params.presence_penalty == 1.0 and params.uses_penalties
    assert params.logit_bias == {7: 2.0, 3: -1.5}
    assert not SamplingParams(logit_bias={}).uses_penalties and SamplingParams(logit_bias={}).logit_bias is None
    with pytest.raises(ValueError, match="logit_bias"):
        params.check_token_ids(7)
    params.check_token_ids(8)


def test_completion_keeps_every_derived_field():
    """Each ``n > 1`` child carries the parent's derived (``init=False``) fields, which
    ``dataclasses.replace`` alone would reset, and is seeded ``seed + index``."""
    from dataclasses import fields

    parent = SamplingParams(n=3, seed=7, bad_words=["x"])
    derived = [f.name for f in fields(SamplingParams) if not f.init]
    assert "bad_words_token_ids" in derived
    for i, name in enumerate(derived):
        setattr(parent, name, [[100 + i]])
    child = parent.completion(2)
    assert (child.n, child.seed, child.bad_words) == (1, 9, ["x"])
    for name in derived:
        assert getattr(child, name) == getattr(parent, name)
        assert getattr(child, name) is not getattr(parent, name)
    assert parent.completion(0).seed == 7 and SamplingParams(n=2).completion(1).seed is None
