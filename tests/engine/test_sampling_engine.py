"""Sampling through the whole engine: seeds, stop conditions, n > 1."""

from __future__ import annotations

import json

import pytest

from conftest import make_tiny_checkpoint, save_byte_tokenizer
from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", initializer_range=0.02)
    return LLM(model=path, num_kv_blocks=128, block_size=8, max_model_len=512)


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tok"), "llama", initializer_range=0.02)
    save_byte_tokenizer(path)
    return LLM(model=path, num_kv_blocks=64, block_size=8, max_model_len=128)


@pytest.fixture(scope="module")
def smol(default_llm):
    return default_llm


PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}
OTHERS = [{"prompt_token_ids": [i, i + 1, i + 2]} for i in range(20, 200, 30)]


def _tokens(outputs):
    return [c.token_ids for o in outputs for c in o.outputs]


def test_seeded_sampling_reproducible_and_batch_independent(tiny):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = _tokens(tiny.generate(PROMPT, params, use_tqdm=False))[0]
    again = _tokens(tiny.generate(PROMPT, params, use_tqdm=False))[0]
    assert alone == again
    unseeded = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    other_seed = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=10, ignore_eos=True)
    mixed = OTHERS[:3] + [PROMPT] + OTHERS[3:]
    mixed_params = [unseeded, other_seed, unseeded, params] + [unseeded] * (len(OTHERS) - 3)
    in_batch = _tokens(tiny.generate(mixed, mixed_params, use_tqdm=False))[3]
    assert in_batch == alone
    different = _tokens(tiny.generate(PROMPT, SamplingParams(temperature=1.0, seed=99, max_tokens=24, ignore_eos=True), use_tqdm=False))[0]
    assert different != alone


def test_seeded_sampling_survives_preemption(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "llama", initializer_range=0.02)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)
    roomy = LLM(model=path, num_kv_blocks=128, block_size=8, max_model_len=256)
    expected = _tokens(roomy.generate([PROMPT] * 4, params, use_tqdm=False))
    tight = LLM(model=path, num_kv_blocks=14, block_size=8, max_model_len=96, watermark=0.0)
    assert _tokens(tight.generate([PROMPT] * 4, params, use_tqdm=False)) == expected
    assert tight.get_stats()["num_preemptions"] > 0


def test_n_completions_differ_and_seeded_n_is_reproducible(tiny):
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    first = tiny.generate(PROMPT, params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3
    second = tiny.generate(PROMPT, params, use_tqdm=False)[0]
    assert _tokens([first]) == _tokens([second])


def test_max_tokens_and_min_tokens(tiny):
    out = tiny.generate(PROMPT, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"
    greedy = out.outputs[0].token_ids
    stop_id = greedy[2]
    stopped = tiny.generate(PROMPT, SamplingParams(temperature=0, max_tokens=7, stop_token_ids=[stop_id]), use_tqdm=False)[0]
    first_stop = greedy.index(stop_id)
    assert stopped.outputs[0].token_ids == greedy[: first_stop + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop_id
    held = tiny.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=7, min_tokens=5, stop_token_ids=[stop_id]), use_tqdm=False
    )[0]
    assert stop_id not in held.outputs[0].token_ids[:5]
    assert len(held.outputs[0].token_ids) >= 5


def test_eos_and_ignore_eos(smol):
    chat = [{"role": "user", "content": "Say hello."}]
    out = smol.chat(chat, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None
    eos = smol.get_tokenizer().eos_token_id
    assert out.outputs[0].token_ids[-1] == eos
    n = len(out.outputs[0].token_ids)
    longer = smol.chat(chat, SamplingParams(temperature=0, max_tokens=n + 5, ignore_eos=True), use_tqdm=False)[0]
    assert len(longer.outputs[0].token_ids) == n + 5


def test_stop_strings(smol):
    prompt = "Count: 1, 2, 3, 4,"
    base = smol.generate(prompt, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0].text
    assert " 7" in base, base
    cut = smol.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop=[" 7"]), use_tqdm=False)[0]
    assert cut.outputs[0].text == base[: base.index(" 7")]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == " 7"
    kept = smol.generate(
        prompt, SamplingParams(temperature=0, max_tokens=20, stop=[" 7"], include_stop_str_in_output=True), use_tqdm=False
    )[0]
    assert kept.outputs[0].text == base[: base.index(" 7") + 2]
    stats = smol.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_multibyte_text_is_never_split(smol):
    out = smol.generate("Le café coûte trois euros, 🙂 and 你好", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    text = out.outputs[0].text
    assert "\ufffd" not in text or "\ufffd" in smol.get_tokenizer().decode(out.outputs[0].token_ids)
    assert text == smol.get_tokenizer().decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_stop_string_completed_by_the_length_capped_token(tiny_with_tokenizer):
    llm = tiny_with_tokenizer
    sample = dict(temperature=1.0, seed=11, ignore_eos=True)
    full = llm.generate("ab", SamplingParams(max_tokens=24, **sample), use_tqdm=False)[0].outputs[0]
    decode = llm.get_tokenizer().decode
    # The shortest output whose last token adds a printable ASCII character not seen before.
    max_tokens, stop = next(
        (k, text[-1])
        for k in range(2, len(full.token_ids) + 1)
        if (text := decode(full.token_ids[:k])) != decode(full.token_ids[: k - 1])
        and text[-1].isprintable() and text[-1].isascii() and text.index(text[-1]) == len(text) - 1
    )
    out = llm.generate("ab", SamplingParams(max_tokens=max_tokens, stop=stop, **sample), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.token_ids == full.token_ids[:max_tokens]
    assert completion.text == decode(full.token_ids[:max_tokens])[:-1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)


def test_n_children_never_collide_with_caller_ids(tiny):
    engine = tiny.llm_engine
    engine.add_request("0_a", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("a", PROMPT, SamplingParams(n=2, max_tokens=5, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == ["0_a", "a"]
    assert [len(c.token_ids) for c in finished["0_a"].outputs] == [3]
    assert [len(c.token_ids) for c in finished["a"].outputs] == [5, 5]
    assert engine.get_num_unfinished_requests() == 0


def test_add_request_that_fails_registers_nothing(tiny):
    engine = tiny.llm_engine
    before = tiny.get_stats()
    with pytest.raises(ValueError, match="seed"):
        engine.add_request("s", PROMPT, SamplingParams(n=2, temperature=1.0, seed=2**64 - 1))
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    engine.add_request("s", PROMPT, SamplingParams(n=2, temperature=1.0, seed=2**64 - 2, max_tokens=4))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == ["s"]
    assert [len(c.token_ids) for c in outputs[0].outputs] == [4, 4]
    stats = tiny.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == before["kv_blocks_total"]
    assert stats["num_requests_finished"] == before["num_requests_finished"] + 1


@pytest.mark.parametrize("source", ["generation_config.json", "config.json"])
def test_every_eos_id_of_the_checkpoint_stops_generation(tmp_path, source):
    path = make_tiny_checkpoint(tmp_path / "m", "llama", initializer_range=0.02)
    kwargs = dict(model=path, num_kv_blocks=32, block_size=8, max_model_len=64)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    tokens = LLM(**kwargs).generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids
    unused = min(set(range(256)) - set(tokens))
    extra = tokens[2]
    config_file = tmp_path / "m" / "config.json"
    config = json.loads(config_file.read_text())
    if source == "generation_config.json":
        config["eos_token_id"] = unused
        (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [unused, extra]}))
    else:
        config["eos_token_id"] = [unused, extra]
        (tmp_path / "m" / "generation_config.json").unlink(missing_ok=True)
    config_file.write_text(json.dumps(config))
    llm = LLM(**kwargs)
    out = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: tokens.index(extra) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", extra)
    ignored = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert ignored[0].outputs[0].token_ids == tokens
