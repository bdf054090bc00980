"""Sampling parameters of one request (the public ``SamplingParams``)."""

from __future__ import annotations

import copy
import json
import math
import numbers
from dataclasses import dataclass, field, fields, replace
from enum import IntEnum
from typing import Any

GREEDY_TEMPERATURE_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``)."""

MAX_LOGPROBS = 20
"""Largest ``logprobs`` (top-N) a request may ask for, besides ``ALL_LOGPROBS``."""

ALL_LOGPROBS = -1
"""``logprobs`` / ``prompt_logprobs`` value asking for the whole vocabulary (vLLM's)."""


def num_top_logprobs(value: int, vocab_size: int) -> int:
    """How many most likely tokens a ``logprobs`` / ``prompt_logprobs`` value asks for."""
    return vocab_size if value == ALL_LOGPROBS else value

MAX_QUOTED_IDS = 32
"""Most out-of-vocabulary token ids one error message lists."""

INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1
"""The integers msgpack carries to the engine core."""

MAX_CHOICES = 10_000
"""Most options a ``choice`` constraint may list (its compile time grows faster than the
options: 20,000 take tens of seconds)."""

MAX_CONSTRAINT_CHARS = 2**18
"""Longest constraint, in characters: a JSON schema's text, a regex, a grammar, or a
``choice``'s options together."""


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, enforced token by token (vLLM's ``StructuredOutputsParams``).

    Exactly one of the fields is set:

    Attributes:
        json: a JSON schema (a dict or its JSON text); the output is a JSON value it validates.
        regex: the output matches this regular expression.
        choice: the output is one of these strings.
        grammar: an EBNF grammar (GBNF / xgrammar syntax, start rule ``root``).
        json_object: the output is any JSON object.
        disable_any_whitespace: a ``json`` constraint allows no whitespace beyond xgrammar's
            compact separators (a small model may otherwise emit newlines until ``max_tokens``).

    Invalid combinations raise ``ValueError``; a constraint that does not compile raises
    ``ValueError`` when the request is added.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)}, got {kinds or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a dict or a str, got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty str, got {value!r}")
        if self.choice is not None and not (
            isinstance(self.choice, (list, tuple))
            and self.choice
            and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                f"got {self.choice!r}"
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                "structured_outputs.disable_any_whitespace must be a bool, "
                f"got {self.disable_any_whitespace!r}"
            )
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {self.json_object!r}")
        self._check_size()

    def _check_size(self) -> None:
        """Refuse constraints too large to compile in reasonable time (``MAX_CHOICES``,
        ``MAX_CONSTRAINT_CHARS``)."""
        kind = self.kind
        if self.choice is not None and len(self.choice) > MAX_CHOICES:
            raise ValueError(
                f"structured_outputs.choice has {len(self.choice)} options; at most "
                f"{MAX_CHOICES} are allowed"
            )
        if kind == "choice":
            size = sum(len(c) for c in self.choice)
        elif kind == "json" and isinstance(self.json, dict):
            size = len(json.dumps(self.json))
        elif kind == "json_object":
            size = 0
        else:
            size = len(getattr(self, kind))
        if size > MAX_CONSTRAINT_CHARS:
            raise ValueError(
                f"structured_outputs.{kind} is {size} characters long; at most "
                f"{MAX_CONSTRAINT_CHARS} are allowed"
            )

    @property
    def kind(self) -> str:
        """Which constraint is set: ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class SamplingType(IntEnum):
    """How a request's tokens are drawn: argmax, or at random from the shared or its own RNG."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to sample the completion of one request.

    Attributes:
        n: number of completions to generate for the prompt.
        temperature: softmax temperature; 0 (anything below 1e-5) means greedy.
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose
            probability sums to at least ``top_p``. 1 = off.
        top_k: keep only the ``top_k`` most likely tokens. 0 or -1 = off (-1 is stored as 0);
            as in vLLM, a ``top_k`` of at least the vocabulary size keeps every token.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely one's.
        seed: seed of this request's own random generator, which makes its samples
            independent of the batch it runs in.
        max_tokens: most tokens to generate; None = up to the model's length.
        min_tokens: tokens to generate before EOS, ``stop_token_ids`` or ``stop`` may end it.
        stop: strings that end generation; the output is cut before the match
            (after it with ``include_stop_str_in_output``). Normalised to a list.
        stop_token_ids: token ids that end generation. Normalised to a list.
        ignore_eos: keep generating after the EOS token.
        logprobs: return the log-probabilities of the sampled token and of the ``logprobs``
            most likely tokens at each position (0 = only the sampled token's), as ``Logprob``
            objects; what they are computed from is the engine's ``logprobs_mode``.
            ``ALL_LOGPROBS`` (-1): every token of the vocabulary.
        prompt_logprobs: likewise for each prompt token (raw logprobs of the prompt's forward
            pass); the first position has none. -1: every token of the vocabulary. A request asking for them never reuses
            prefix-cached blocks, so every prompt position is computed.
        skip_special_tokens: leave special tokens out of the output text.
        include_stop_str_in_output: keep a matched stop string in the output text.
        presence_penalty: subtracted from the logit of every token already in the output,
            in [-2, 2].
        frequency_penalty: times its count in the output, subtracted from each token's logit,
            in [-2, 2].
        repetition_penalty: > 0; the logits of tokens in the prompt or the output are divided
            by it where positive and multiplied by it where negative (1 = off).
        logit_bias: token id -> bias added to its logit.
        allowed_token_ids: only these token ids may be sampled.
        bad_words: words never to generate (vLLM's semantics): each is tokenized with and
            without a leading space, and a word's last token is banned wherever the output
            ends with the tokens before it.
        structured_outputs: constrain the output to a JSON schema, regex, choice or grammar.
        extra_args: vLLM's ``extra_args``; the one key the engine takes is
            ``kv_transfer_params`` (a dict), which reaches the engine's KV connector (see
            ``kv_transfer_config``). Any other key is refused.

    Greedy requests (temperature 0) ignore ``top_p``, ``top_k`` and ``min_p``, which are
    reset to their off values. Every integer must fit in 64 bits (``[-2**63, 2**64)``), as
    the engine core receives it. Invalid values raise ``ValueError`` naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = None
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False)
    """``bad_words`` tokenized, set by ``update_from_tokenizer``."""

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n, minimum=1)
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _check_int("top_k", self.top_k, minimum=-1)
        self.min_p = _check_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed)
        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens, minimum=1)
        self.min_tokens = _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value != ALL_LOGPROBS:
                value = _check_int(name, value, minimum=0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be <= {MAX_LOGPROBS}, got {value}")
                setattr(self, name, value)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.stop = _normalise_stop(self.stop)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _check_token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        self._check_extra_args()
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list)
            or not all(isinstance(w, str) and w.strip() for w in self.bad_words)
        ):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = _structured_outputs_from_dict(self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, "
                f"got {self.structured_outputs!r}"
            )

        if self.top_k == -1:
            self.top_k = 0
        if self.is_greedy:
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling (temperature=0), got {self.n}")
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def uses_penalties(self) -> bool:
        """Whether any of the presence, frequency or repetition penalties is on."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the field if a ``logit_bias`` or ``allowed_token_ids`` id
        is outside ``[0, vocab_size)``."""
        for name, ids in (("logit_bias", self.logit_bias), ("allowed_token_ids", self.allowed_token_ids)):
            bad = [t for t in ids or () if t >= vocab_size]
            if bad:
                raise ValueError(
                    f"{name} token id(s) {_quote(bad)} are outside the vocabulary "
                    f"[0, {vocab_size})"
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    def update_from_generation_config(
        self, generation_config: dict[str, Any], model_eos_token_id: int | None = None
    ) -> None:
        """Stop also at the checkpoint's other EOS ids (vLLM's method of the same name).

        ``generation_config["eos_token_id"]`` (an int or a list) may name EOS ids besides the
        model's ``model_eos_token_id`` (Llama 3 has two); unless ``ignore_eos``, they join
        ``stop_token_ids``, so a completion they end reports the id as its ``stop_reason``.
        """
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is None or self.ignore_eos:
            return
        eos_ids = [eos_ids] if _is_int(eos_ids) else list(eos_ids)
        extra = [int(i) for i in eos_ids if i != model_eos_token_id]
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids + extra))

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize ``bad_words`` into ``bad_words_token_ids`` as vLLM does: each word as
        given (stripped of leading spaces) and with one leading space, the latter only when it
        tokenizes to as many tokens with a different first one."""
        if not self.bad_words:
            return
        self.bad_words_token_ids = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            self.bad_words_token_ids.append(plain)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if len(spaced) == len(plain) and spaced[0] != plain[0]:
                self.bad_words_token_ids.append(spaced)

    def completion(self, index: int) -> SamplingParams:
        """The ``n == 1`` params of completion ``index`` of this request, seeded ``seed + index``.

        Derived fields (``init=False``, such as ``bad_words_token_ids``) are copied too:
        ``dataclasses.replace`` re-runs the constructor, which leaves them at their defaults.
        Raises ``ValueError`` if the copy is invalid (a seed past 64 bits)."""
        child = replace(self, n=1, seed=None if self.seed is None else self.seed + index)
        for f in fields(self):
            if not f.init:
                setattr(child, f.name, copy.deepcopy(getattr(self, f.name)))
        return child

    def _check_extra_args(self) -> None:
        if self.extra_args is None:
            return
        if not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict, got {self.extra_args!r}")
        unknown = sorted(set(self.extra_args) - {"kv_transfer_params"})
        if unknown:
            raise ValueError(
                f"extra_args has key(s) {', '.join(map(repr, unknown))} this engine does not "
                "take; the one it takes is 'kv_transfer_params'"
            )
        params = self.extra_args.get("kv_transfer_params")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"kv_transfer_params must be a dict, got {params!r}")

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        """``extra_args["kv_transfer_params"]``, or None."""
        return (self.extra_args or {}).get("kv_transfer_params")

    def clone(self) -> SamplingParams:
        """A deep copy, so per-request changes never touch a params object shared by a batch."""
        return copy.deepcopy(self)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int | None = None) -> int:
    """Return ``value`` as an ``int`` (numpy integers included) that fits in 64 bits; bools and
    floats are rejected."""
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if not INT64_MIN <= value <= UINT64_MAX:
        raise ValueError(f"{name} must fit in 64 bits, got {value}")
    return int(value)


def _check_float(name: str, value: Any) -> float:
    """Return ``value`` as a ``float``; it must be a finite real number (not a bool or a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _structured_outputs_from_dict(fields: dict[str, Any]) -> StructuredOutputsParams:
    supported = StructuredOutputsParams.__dataclass_fields__
    unknown = sorted(set(fields) - set(supported))
    if unknown:
        raise ValueError(
            f"structured_outputs has unknown or unsupported field(s) {unknown}; "
            f"supported: {', '.join(supported)}"
        )
    return StructuredOutputsParams(**fields)


def _normalise_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
    return list(stop)


def _normalise_stop_token_ids(ids: Any) -> list[int]:
    if ids is None:
        return []
    return _check_token_ids("stop_token_ids", ids)


def _check_token_ids(name: str, ids: Any) -> list[int]:
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{name} must be a list of ints, got {ids!r}")
    for i in ids:
        if not _is_int(i) or not 0 <= i <= UINT64_MAX:
            raise ValueError(f"{name} must contain only non-negative 64-bit ints, got {i!r}")
    return [int(i) for i in ids]


def _quote(items: list[Any]) -> str:
    """The first ``MAX_QUOTED_IDS`` items, and how many more there are."""
    listed = ", ".join(map(repr, items[:MAX_QUOTED_IDS]))
    more = len(items) - MAX_QUOTED_IDS
    return listed + (f" and {more} more" if more > 0 else "")


def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
    """``{token id: bias}`` with int ids (numeric strings, as JSON sends them, are accepted)."""
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    out: dict[int, float] = {}
    bad_keys = []
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        if not _is_int(token) or token < 0:
            bad_keys.append(key)
            continue
        out[int(token)] = _check_float("logit_bias", value)
    if bad_keys:
        raise ValueError(
            f"logit_bias keys must be non-negative token ids, got {_quote(bad_keys)}"
        )
    return out
