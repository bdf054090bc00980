"""docs/vllm_compatibility.md lists every request field beyond OpenAI's that the server
accepts, and exactly the vLLM fields it refuses."""

from __future__ import annotations

import re
from pathlib import Path

from tokenmill.entrypoints.openai.protocol import (
    VLLM_UNIMPLEMENTED_DEFAULTS,
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
    TokenizeChatRequest,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm_compatibility.md"

OPENAI_FIELDS = {
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
    "temperature", "top_p", "user", "messages", "max_completion_tokens", "metadata",
    "parallel_tool_calls", "store", "tool_choice", "tools", "top_logprobs", "response_format",
}
"""The request fields of OpenAI's completions and chat completions APIs."""
TOKENIZE_ONLY = {"return_token_strs"}
"""``/tokenize``'s own fields (vLLM's, documented with its endpoint)."""


def table_names(section: str) -> set[str]:
    """The backticked names in the first column of the tables of ``section``."""
    names = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            names |= set(re.findall(r"`([^`]+)`", first))
    return names


def sections() -> tuple[str, str]:
    text = DOC.read_text()
    accepted = text.split("## Request fields beyond OpenAI's", 1)[1].split("### Refused", 1)[0]
    refused = text.split("### Refused", 1)[1].split("\n## ", 1)[0]
    return accepted, refused


def test_accepted_fields_are_documented():
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    fields |= set(TokenizeChatRequest.model_fields) - TOKENIZE_ONLY
    fields |= {f"stream_options.{name}" for name in StreamOptions.model_fields}
    documented = table_names(sections()[0])
    assert fields - OPENAI_FIELDS - {"stream_options.include_usage"} <= documented
    assert documented <= fields


def test_refused_fields_are_documented():
    refused = table_names(sections()[1])
    assert refused == set(VLLM_UNIMPLEMENTED_DEFAULTS) | {"best_of", "suffix"}
    assert refused.isdisjoint(CompletionRequest.model_fields.keys() - {"best_of", "suffix"})
