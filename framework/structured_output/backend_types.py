"""The interface a structured-output backend implements (vLLM's ``backend_types``).

A backend compiles a ``StructuredOutputsParams`` into a ``StructuredOutputGrammar``: a matcher
that follows the tokens a request has produced and, before each sampled token, writes the set
of tokens the constraint allows into one row of a batch-wide bitmask (bit ``t % 32`` of int32
word ``t // 32`` is set when token ``t`` is allowed)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tokenmill.sampling_params import StructuredOutputsParams


class StructuredOutputGrammar(ABC):
    """The matcher state of one request."""

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance over ``tokens``; False if one of them is not allowed (the rest are skipped)."""

    @abstractmethod
    def fill_bitmasks(self, bitmask: torch.Tensor, index: int, drafts: list[int]) -> None:
        """Write the tokens allowed next into row ``index`` of ``bitmask``, and after each of
        ``drafts`` (valid, see ``validate_tokens``) into the rows after it; the matcher ends
        where it started."""

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the constraint allows that does not complete it
        (a token that completes it is left for the target to sample); the matcher ends
        where it started."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the constraint is complete and has accepted its stop token."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer and vocabulary size."""

    @classmethod
    @abstractmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        """Raise ``ValueError`` naming the problem if ``params`` cannot compile; needs no
        tokenizer, so the front end checks requests before they reach the engine core."""

    @abstractmethod
    def compile_grammar(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """A fresh matcher for ``params``; compiled grammars are cached across requests."""

    @abstractmethod
    def allocate_token_bitmask(self, num_rows: int) -> torch.Tensor:
        """An int32 ``[num_rows, ceil(vocab_size / 32)]`` bitmask."""
