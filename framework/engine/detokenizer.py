"""Incremental detokenization and stop-string matching for one completion."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from tokenmill.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens decoded as context before the first output token (vLLM's initial offset)."""

_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class StopMatch:
    """A stop string completed by one of the token ids passed to ``update``.

    Attributes:
        stop_str: the stop string.
        num_tokens: how many of those ids the output keeps: up to the one that completed it.
    """

    stop_str: str
    num_tokens: int


class IncrementalDetokenizer:
    """Turns one completion's token ids into text as they arrive, and finds stop strings.

    Each token costs two decodes of a short window of recent ids (vLLM's
    prefix_offset/read_offset algorithm): the window is ``context + pending``, where
    ``context`` are ids whose text was already emitted and ``pending`` ids whose text was
    not. The text emitted is ``decode(window)`` minus ``decode(context)``; decoding with
    context keeps what decoders do to a sequence's first token (such as dropping its
    leading space) from changing the output. While the window's text ends in U+FFFD (a
    multi-byte character split across tokens) or has not grown (a skipped special token),
    nothing is emitted and the window grows; otherwise ``pending`` becomes the new context.

    Attributes:
        output_token_ids: the output token ids ``update`` took.
        output_text: the text so far, cut at a matched stop string.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or ())
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.stop_buffer_length = (
            max(map(len, self.stop)) - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self._window: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._window)
        self._last_output_text_offset = 0

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> StopMatch | None:
        """Append ``new_token_ids``, extend ``output_text`` and check the stop strings.

        ``stop_terminated``: the last id ended the request (EOS or a stop token id); as in
        vLLM, its text is left out unless ``include_stop_str_in_output``.

        The ids are taken one at a time, exactly as if each arrived in a step of its own (a
        speculative step brings several): once more than ``min_tokens`` tokens exist, stop
        strings are looked for in the text each token adds plus the tail before it, so a stop
        string spanning tokens is found. The first token at which one completes ends the
        output: the ids after it are not taken, ``output_text`` is cut before the match
        (after it with ``include_stop_str_in_output``), and the match is returned; else None.
        """
        if not new_token_ids:
            return None
        skipped_id = None
        if stop_terminated and not self.include_stop_str_in_output:
            *new_token_ids, skipped_id = new_token_ids
        for num_taken, token_id in enumerate(new_token_ids, 1):
            self.output_token_ids.append(token_id)
            new_text = self._decode_next(token_id)
            self.output_text += new_text
            if not self.stop or len(self.output_token_ids) <= self.min_tokens:
                continue
            match = find_stop_string(
                self.output_text, len(new_text), self.stop, self.include_stop_str_in_output
            )
            if match is not None:
                stop_str, truncate_to = match
                self.output_text = self.output_text[:truncate_to]
                return StopMatch(stop_str, num_taken)
        if skipped_id is not None:
            self.output_token_ids.append(skipped_id)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to report now: all of it, or with ``delta`` only what was not reported before.

        Until ``finished``, the last ``max(len(stop)) - 1`` characters are held back, since
        they could be the start of a stop string that must not be shown.
        """
        buffer = 0 if finished else self.stop_buffer_length
        end = max(len(self.output_text) - buffer, 0)
        if not delta:
            return self.output_text[:end]
        start = self._last_output_text_offset
        if start >= end:
            return ""
        self._last_output_text_offset = end
        return self.output_text[start:end]

    def _decode_next(self, token_id: int) -> str:
        self._window.append(token_id)
        context_text = self._decode(self._window[: self._read_offset])
        window_text = self._decode(self._window)
        if len(window_text) <= len(context_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        return window_text[len(context_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        text: str = self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        return text


def find_stop_string(
    text: str, new_char_count: int, stop: list[str], include_stop_str: bool
) -> tuple[str, int] | None:
    """Find the earliest stop string in ``text`` that ends within its last ``new_char_count``
    characters; return it and the length to cut ``text`` to, or None."""
    if new_char_count <= 0:
        return None
    best: tuple[int, str] | None = None
    for stop_str in stop:
        start = max(0, len(text) - new_char_count - len(stop_str) + 1)
        index = text.find(stop_str, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_str)
    if best is None:
        return None
    index, stop_str = best
    return stop_str, index + len(stop_str) if include_stop_str else index
