import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tokenmill.engine.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer
from tokenmill.sampling_params import SamplingParams

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Streaming text one token at a time is how engines talk.",
    "Emoji travel well: 😀 🤖 🧠 🚀 and so do accents: café, naïve, Ünïcödé.",
    "日本語のテキストも大丈夫です。中文也可以。한국어도 됩니다.",
    "Stop strings like ### or END may span several tokens.",
]
TEXT = "Hello there! 😀 The fox said 日本語 is fine. ### END 🤖🧠 naïve café, done."


class Recording:
    """A tokenizer proxy that records the longest id list passed to decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.longest = 0

    def encode(self, text):
        return self.tokenizer.encode(text)

    def decode(self, ids, **kwargs):
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny byte-level BPE whose vocabulary is too small to hold whole multi-byte characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", clean_up_tokenization_spaces=False
    )


@pytest.fixture(scope="module")
def smollm_tokenizer():
    try:
        from tokenmill.default_model import default_model_path

        path = default_model_path()
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"default model unavailable: {e}")
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(params=["byte_bpe", "smollm2"])
def tokenizer(request, byte_tokenizer):
    return byte_tokenizer if request.param == "byte_bpe" else request.getfixturevalue("smollm_tokenizer")


def run(tokenizer, ids, prompt="Prompt: 日本", **params):
    """Feed ``ids`` one at a time; return the detokenizer, per-step texts, deltas and stop result."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), SamplingParams(**params))
    texts, deltas, stopped = [], [], None
    for token_id in ids:
        match = detok.update([token_id])
        stopped = None if match is None else match.stop_str
        texts.append(detok.output_text)
        deltas.append(detok.get_next_output_text(finished=stopped is not None, delta=True))
        if stopped:
            break
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return detok, texts, deltas, stopped


def test_byte_tokenizer_splits_multibyte_characters(byte_tokenizer):
    pieces = [byte_tokenizer.decode([i]) for i in byte_tokenizer.encode(TEXT)]
    assert any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_text_equals_full_decode(tokenizer, skip_special_tokens):
    ids = tokenizer.encode(TEXT) + [tokenizer.eos_token_id] + tokenizer.encode(" after")
    full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "\ufffd" not in full
    detok, texts, deltas, stopped = run(tokenizer, ids, skip_special_tokens=skip_special_tokens)
    assert stopped is None
    assert all("\ufffd" not in text for text in texts)
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert detok.output_text == full
    assert "".join(deltas) == full
    assert detok.output_token_ids == ids
    assert (tokenizer.eos_token in full) is not skip_special_tokens


def test_decode_cost_is_bounded_by_a_window(byte_tokenizer):
    recording = Recording(byte_tokenizer)
    ids = byte_tokenizer.encode(TEXT * 20)
    detok, _, _, _ = run(recording, ids, prompt="")
    assert detok.output_text == byte_tokenizer.decode(ids)
    assert recording.longest <= PROMPT_CONTEXT_TOKENS + 8


def _spans_tokens(tokenizer, ids, stop: str) -> bool:
    return stop in tokenizer.decode(ids) and not any(stop in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("stop", ["### END", "said 日本", "🤖🧠"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_truncates(tokenizer, stop, include):
    ids = tokenizer.encode(TEXT)
    assert _spans_tokens(tokenizer, ids, stop)
    detok, _, deltas, stopped = run(tokenizer, ids, stop=["never", stop], include_stop_str_in_output=include)
    assert stopped == stop
    index = TEXT.index(stop)
    expected = TEXT[: index + len(stop)] if include else TEXT[:index]
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    assert len(detok.output_token_ids) < len(ids)


def test_streaming_never_shows_part_of_a_stop_string(byte_tokenizer):
    stop = "### END"
    _, _, deltas, _ = run(byte_tokenizer, byte_tokenizer.encode(TEXT), stop=[stop])
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert "#" not in streamed
    assert streamed == TEXT[: TEXT.index(stop)]


def _feed(detok: IncrementalDetokenizer, ids: list[int], chunk: int, stop_terminated: bool):
    """``ids`` in updates of ``chunk`` ids (a speculative step brings several); returns the ids
    taken and the stop string, as the output processor keeps them."""
    taken = []
    for start in range(0, len(ids), chunk):
        new = ids[start : start + chunk]
        match = detok.update(new, stop_terminated and start + chunk >= len(ids))
        if match is not None:
            return taken + new[: match.num_tokens], match.stop_str
        taken += new
    return taken, None


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop_terminated", [False, True])
@pytest.mark.parametrize(
    "stop",
    [["gamma", "beta"], ["beta gamma", "a g"], ["a g", "beta gamma"], ["ta", "lph"], ["nowhere"]],
    ids=["apart", "overlap", "overlap-swapped", "inside-one-token", "none"],
)
def test_several_tokens_per_update_equal_one_per_update(byte_tokenizer, stop, stop_terminated, include):
    """The first token at which any stop string completes ends the output, however many ids an
    update brings: the ids after it are not taken, and the text is the one-by-one text."""
    ids = byte_tokenizer.encode("alpha beta gamma delta")
    params = SamplingParams(stop=stop, include_stop_str_in_output=include, skip_special_tokens=False)
    one = IncrementalDetokenizer(byte_tokenizer, [], params)
    expected = _feed(one, ids, 1, stop_terminated)
    for chunk in range(2, len(ids) + 1):
        detok = IncrementalDetokenizer(byte_tokenizer, [], params)
        assert _feed(detok, ids, chunk, stop_terminated) == expected
        assert detok.output_text == one.output_text
        assert detok.output_token_ids == one.output_token_ids == expected[0]


def test_first_completed_stop_string_wins(byte_tokenizer):
    """Of overlapping stop strings the one that completes first wins, not the one that starts
    first (as when tokens arrive one per step)."""
    ids = byte_tokenizer.encode("alpha beta gamma")
    detok = IncrementalDetokenizer(byte_tokenizer, [], SamplingParams(stop=["beta gamma", "a g"]))
    match = detok.update(ids)
    assert match is not None and match.stop_str == "a g"
    assert detok.output_text == "alpha bet"
    assert byte_tokenizer.decode(ids[: match.num_tokens]).endswith("a g")
    assert not byte_tokenizer.decode(ids[: match.num_tokens - 1]).endswith("a g")


def test_non_delta_output_is_the_whole_text_minus_the_held_back_tail(byte_tokenizer):
    detok = IncrementalDetokenizer(byte_tokenizer, [], SamplingParams(stop=["xyz"]))
    detok.update(byte_tokenizer.encode("hello world"))
    assert detok.get_next_output_text(finished=False, delta=False) == "hello wor"
    assert detok.get_next_output_text(finished=True, delta=False) == "hello world"
    assert detok.get_next_output_text(finished=False, delta=True) == "hello wor"
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=True) == "ld"


def test_text_shorter_than_the_held_back_tail_is_all_held(byte_tokenizer):
    detok = IncrementalDetokenizer(byte_tokenizer, [], SamplingParams(stop=["a long stop"]))
    detok.update(byte_tokenizer.encode("abc"))
    assert detok.get_next_output_text(finished=False, delta=False) == ""
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=True) == "abc"


def test_stop_strings_wait_for_min_tokens(byte_tokenizer):
    ids = byte_tokenizer.encode("a ### b ### c")
    first = byte_tokenizer.decode(ids).index("###")
    min_tokens = next(n for n in range(len(ids)) if len(byte_tokenizer.decode(ids[:n])) > first + 3)
    detok, _, _, stopped = run(byte_tokenizer, ids, stop=["###"], min_tokens=min_tokens)
    assert stopped == "###" and detok.output_text == "a ### b "


def test_stop_terminated_token_text_is_left_out(byte_tokenizer):
    ids = byte_tokenizer.encode("one two.")
    for include, expected in [(False, "one two"), (True, "one two.")]:
        detok = IncrementalDetokenizer(
            byte_tokenizer, [], SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        )
        assert detok.update(ids, stop_terminated=True) is None
        assert detok.output_text == expected
        assert detok.output_token_ids == ids
