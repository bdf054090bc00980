"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's endpoints of the same names)."""

from __future__ import annotations

import json

from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.entrypoints.openai.chat_template import ChatRenderer
from tokenmill.entrypoints.openai.errors import OpenAIError
from tokenmill.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizerInfoResponse,
    TokenizeResponse,
)
from tokenmill.entrypoints.openai.serving_models import ServedModels
from tokenmill.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def __init__(
        self, engine: AsyncLLM, models: ServedModels, renderer: ChatRenderer
    ) -> None:
        super().__init__(engine, models)
        self.renderer = renderer

    def tokenize_request(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        """The token ids of a prompt, or of messages under the chat template; raises
        ``OpenAIError``."""
        tokenizer = self._tokenizer(request.model)
        if isinstance(request, TokenizeChatRequest):
            text = self.renderer.render(
                request.messages,
                request.tools,
                request.add_generation_prompt,
                request.continue_final_message,
                request.chat_template_kwargs,
                request.documents,
                request.chat_template,
            )
        else:
            text = request.prompt
        ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        return TokenizeResponse(
            tokens=ids,
            count=len(ids),
            max_model_len=self.engine.max_model_len,
            token_strs=tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None,
        )

    def tokenizer_info(self, _: None = None) -> TokenizerInfoResponse:
        """The tokenizer's class and settings, and the chat template in use."""
        tokenizer = self._tokenizer(None)
        settings = json.loads(json.dumps(tokenizer.init_kwargs, default=str))
        settings.pop("tokenizer_class", None)
        settings["chat_template"] = self.renderer.template or getattr(
            tokenizer, "chat_template", None
        )
        return TokenizerInfoResponse(tokenizer_class=type(tokenizer).__name__, **settings)

    def detokenize_request(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids; an id outside the vocabulary is a 400."""
        tokenizer = self._tokenizer(request.model)
        vocab_size = len(tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(
                f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="tokens"
            )
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))

    def _tokenizer(self, model: str | None):
        self.models.resolve(model)
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise OpenAIError("this model has no tokenizer")
        return tokenizer
