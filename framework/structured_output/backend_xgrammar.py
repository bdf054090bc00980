"""The xgrammar backend: JSON schema, regex, choice, EBNF and any-JSON-object constraints."""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
)

CACHE_LIMIT_BYTES = 256 * 2**20
"""Most memory xgrammar's compiler keeps compiled grammars in."""

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return all(self.matcher.accept_token(t) for t in tokens)

    def fill_bitmasks(self, bitmask: torch.Tensor, index: int, drafts: list[int]) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)
        for j, token in enumerate(drafts):
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"draft token {token} was validated but the grammar rejects it")
            self.matcher.fill_next_token_bitmask(bitmask, index + 1 + j)
        if drafts:
            self.matcher.rollback(len(drafts))

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        valid = 0
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            if self.matcher.is_terminated():
                self.matcher.rollback(1)
                break
            valid += 1
        if valid:
            self.matcher.rollback(valid)
        return tokens[:valid]

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class XgrammarBackend(StructuredOutputBackend):
    """``tokenizer`` is an HF tokenizer; ``vocab_size`` the model's (logits') vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(
            info, max_threads=1, cache_enabled=True, cache_limit_bytes=CACHE_LIMIT_BYTES
        )

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        kind = params.kind
        try:
            if kind == "json":
                xgr.Grammar.from_json_schema(_schema_text(params.json))
            elif kind == "regex":
                xgr.Grammar.from_regex(params.regex)
            elif kind in ("choice", "grammar"):
                xgr.Grammar.from_ebnf(_ebnf(params))
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind} does not compile: {_message(e)}") from None

    def compile_grammar(self, params: StructuredOutputsParams) -> XgrammarGrammar:
        kind = params.kind
        if kind == "json":
            compiled = self.compiler.compile_json_schema(
                _schema_text(params.json), any_whitespace=not params.disable_any_whitespace
            )
        elif kind == "json_object":
            compiled = self.compiler.compile_builtin_json_grammar()
        elif kind == "regex":
            compiled = self.compiler.compile_regex(params.regex)
        else:
            compiled = self.compiler.compile_grammar(_ebnf(params))
        return XgrammarGrammar(xgr.GrammarMatcher(compiled))

    def allocate_token_bitmask(self, num_rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)


def _schema_text(schema: str | dict[str, Any]) -> str:
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the schema is not valid JSON: {e}") from None
        return schema
    return json.dumps(schema)


def _ebnf(params: StructuredOutputsParams) -> str:
    if params.choice is not None:
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
    assert params.grammar is not None
    return params.grammar


def _message(e: Exception) -> str:
    """xgrammar's message without its ``[time] file:line:`` prefix."""
    return _LOG_PREFIX.sub("", str(e).strip())
