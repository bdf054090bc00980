"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's endpoints of the same names)."""

from __future__ import annotations

from tokenmill.entrypoints.openai.errors import OpenAIError
from tokenmill.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from tokenmill.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def tokenize_request(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        """The token ids of a prompt, or of messages under the chat template; raises
        ``OpenAIError``."""
        tokenizer = self._tokenizer(request.model)
        if isinstance(request, TokenizeChatRequest):
            if not request.messages:
                raise OpenAIError("messages must not be empty", param="messages")
            try:
                text = tokenizer.apply_chat_template(
                    [m.to_template_dict() for m in request.messages],
                    add_generation_prompt=request.add_generation_prompt,
                    tokenize=False,
                )
            except Exception as e:
                raise OpenAIError(f"cannot apply the chat template: {e}", param="messages") from None
        else:
            text = request.prompt
        ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        return TokenizeResponse(
            tokens=ids,
            count=len(ids),
            max_model_len=self.engine.max_model_len,
            token_strs=tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None,
        )

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
