"""``speculative_config``: vLLM's keys, checked, with errors that name the key."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

DEFAULT_DISABLE_BY_BATCH_SIZE = 8
"""Running requests from which a step does not speculate, when the config does not say, for
``ngram`` and plugin methods; methods with a model of their own stop at
``MODEL_DISABLE_BY_BATCH_SIZE``.

Chosen from ``benchmarks/spec_decode.py`` on the default model (2 cores of an AMD EPYC,
2026-12-02, speculating at any batch size against none): ``ngram`` k = 3 on copy prompts pays
1.24x at 2 requests and 1.39x at 4 (3.5 tokens per verification step), and costs 4 % at 32
(k = 4); the shipped EAGLE heads at k = 2 on chat prompts (1.6 tokens per step) pay 1.3-1.4x
at one request but cost at 2, 4 and 8 requests (0.84-0.90x, 0.68-0.69x, 0.91-0.98x): from 2
requests a verification step has more rows than the float32 CPU graphs take, and its cost
grows with them while the drafts accepted stay few."""

MODEL_DISABLE_BY_BATCH_SIZE = 2
"""The default cut-off of the methods in ``MODEL_METHODS`` (see ``DEFAULT_DISABLE_BY_BATCH_SIZE``)."""

MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
"""Methods that run a model of their own, named by the ``model`` key. Their draft lengths are
adaptive by default (``adaptive_draft_length``)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings.

    Attributes:
        method: the registered proposer (``ngram``, ``draft_model``, ``eagle``, ``eagle3``,
            ``mtp``, or a plugin's).
        num_speculative_tokens: draft tokens proposed per request and step (k).
        model: the draft model's or head's HF directory (``draft_model``, ``eagle``,
            ``eagle3``; ``mtp`` uses the target's own checkpoint).
        prompt_lookup_min: shortest suffix the n-gram proposer matches.
        prompt_lookup_max: longest suffix the n-gram proposer matches. Given to a method in
            ``MODEL_METHODS`` (either key; the other defaults to it), a request's drafts come
            from the same lookup where it finds a match, from the model elsewhere; None: the
            model's only.
        disable_by_batch_size: a step with at least this many running requests does not
            speculate; 0 speculates at any batch size (default: 0 with adaptive draft lengths,
            which find the cut-off themselves; else 2 for the methods with a model, 8 for the
            others).
        adaptive_draft_length: each request drafts up to ``num_speculative_tokens`` tokens as
            its measured acceptance and the measured cost of drafts at the running batch size
            pay (``tokenmill.core.draft_length_policy``); False: always
            ``num_speculative_tokens`` below ``disable_by_batch_size`` (vLLM's behaviour).
            A tokenmill key; default True for ``MODEL_METHODS``, False for the others.
        extra: further keys, allowed only for plugin methods, which read them themselves.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    adaptive_draft_length: bool = False
    extra: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        """Check ``raw`` (``speculative_config``) and fill the defaults vLLM fills."""
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(raw).__name__}")
        raw = dict(raw)
        method = raw.pop("method", None)
        model = raw.pop("model", None)
        if method is None:
            if model is None:
                raise ValueError("speculative_config needs 'method' (or 'model' for draft_model)")
            method = "draft_model"
        if not isinstance(method, str) or not method:
            raise ValueError(f"speculative_config['method'] must be a name, got {method!r}")
        if model is not None:
            if method == "ngram":
                raise ValueError(
                    f"speculative_config['model'] does not apply to method {method!r}"
                )
            if not isinstance(model, str) or not os.path.isdir(os.path.expanduser(model)):
                raise ValueError(
                    f"speculative_config['model'] must be a model directory, got {model!r}"
                )
            model = os.path.expanduser(model)
        elif method == "draft_model":
            raise ValueError("speculative_config['model'] is required for method 'draft_model'")
        k = raw.pop("num_speculative_tokens", None)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"speculative_config['num_speculative_tokens'] must be a positive integer, got {k!r}"
            )
        lookup_min = raw.pop("prompt_lookup_min", None)
        lookup_max = raw.pop("prompt_lookup_max", None)
        if method == "ngram" or (
            method in MODEL_METHODS and (lookup_min is not None or lookup_max is not None)
        ):
            lookup_min, lookup_max = _lookup_bounds(lookup_min, lookup_max)
        elif lookup_min is not None or lookup_max is not None:
            key = "prompt_lookup_min" if lookup_min is not None else "prompt_lookup_max"
            raise ValueError(
                f"speculative_config[{key!r}] applies to methods {', '.join(BUILTIN_METHODS)} only"
            )
        adaptive = raw.pop("adaptive_draft_length", method in MODEL_METHODS)
        if not isinstance(adaptive, bool):
            raise ValueError(
                f"speculative_config['adaptive_draft_length'] must be true or false, got {adaptive!r}"
            )
        if adaptive:
            default = 0
        elif method in MODEL_METHODS:
            default = MODEL_DISABLE_BY_BATCH_SIZE
        else:
            default = DEFAULT_DISABLE_BY_BATCH_SIZE
        disable = raw.pop("disable_by_batch_size", default)
        if disable is None:
            disable = 0
        if isinstance(disable, bool) or not isinstance(disable, int) or disable < 0:
            raise ValueError(
                "speculative_config['disable_by_batch_size'] must be a non-negative integer "
                f"(0: never), got {disable!r}"
            )
        if raw and method in BUILTIN_METHODS:
            raise ValueError(
                f"unknown speculative_config key(s) for method {method!r}: "
                f"{', '.join(sorted(raw))}; known: {', '.join(KNOWN_KEYS)}"
            )
        return cls(
            method, k, model, lookup_min, lookup_max, disable, adaptive, tuple(sorted(raw.items()))
        )


BUILTIN_METHODS = ("ngram", *MODEL_METHODS)

KNOWN_KEYS = (
    "method",
    "num_speculative_tokens",
    "model",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "adaptive_draft_length",
)


def _lookup_bounds(lookup_min: Any, lookup_max: Any) -> tuple[int, int]:
    """vLLM's defaults: both 5 when neither is given, else the one given for the other."""
    if lookup_min is None and lookup_max is None:
        return 5, 5
    for key, value in (("prompt_lookup_min", lookup_min), ("prompt_lookup_max", lookup_max)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"speculative_config[{key!r}] must be a positive integer, got {value!r}")
    lookup_min = lookup_max if lookup_min is None else lookup_min
    lookup_max = lookup_min if lookup_max is None else lookup_max
    if lookup_min > lookup_max:
        raise ValueError(
            f"speculative_config['prompt_lookup_min'] ({lookup_min}) must be <= "
            f"'prompt_lookup_max' ({lookup_max})"
        )
    return lookup_min, lookup_max
