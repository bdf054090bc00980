"""The models a server answers to: the base model's names and the LoRA adapters loaded over
it (``--lora-modules``, or at run time), each chosen by a request's ``model``."""

from __future__ import annotations

from http import HTTPStatus

from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.entrypoints.openai.errors import OpenAIError, model_not_found
from tokenmill.entrypoints.openai.protocol import ModelCard
from tokenmill.lora.request import LoRARequest


class ServedModels:
    """The base names (the first is the one responses name) and the adapters by name. Each
    adapter loaded gets a new ``lora_int_id``, so a name unloaded and loaded again never
    shares a slot or prefix-cache blocks with its former self."""

    def __init__(self, engine: AsyncLLM, base_names: list[str]) -> None:
        self.engine = engine
        self.base_names = base_names
        self.model_name = base_names[0]
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names, None for the base model; 404 for a name not served."""
        if model is None or model in self.base_names:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise model_not_found(model)
        return adapter

    def add_adapter(self, name: str, path: str) -> LoRARequest:
        """Check the adapter at ``path`` (reading it: call it off the event loop) and serve it
        as ``name``; a 400 naming the problem when it cannot be served."""
        if not self.engine.config.enable_lora:
            raise OpenAIError("LoRA adapters need a server started with --enable-lora", param="lora_name")
        if name in self.base_names or name in self.adapters:
            raise OpenAIError(f"the model name {name!r} is already in use", param="lora_name")
        try:
            request = LoRARequest(name, self._next_id, path)
            self.engine.input_processor.check_lora(request)
        except ValueError as e:
            raise OpenAIError(str(e), param="lora_path") from None
        self._next_id += 1
        self.adapters[name] = request
        return request

    async def load_adapter(self, name: str, path: str) -> LoRARequest:
        """:meth:`add_adapter` on the engine's tokenizer thread, which also checks the
        requests' adapters, so additions never race."""
        return await self.engine.run_off_loop(self.add_adapter, name, path)

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` (requests running with it finish); 404 if unknown."""
        request = self.adapters.pop(name, None)
        if request is None:
            raise OpenAIError(
                f"The LoRA adapter `{name}` is not loaded.",
                HTTPStatus.NOT_FOUND,
                param="lora_name",
                code="model_not_found",
            )
        self.engine.input_processor.forget_lora(request.lora_int_id)

    def cards(self) -> list[ModelCard]:
        """The base model's cards, then one per adapter (``parent``: the base model)."""
        root, max_len = self.engine.config.model_path, self.engine.max_model_len
        return [ModelCard(id=name, root=root, max_model_len=max_len) for name in self.base_names] + [
            ModelCard(id=name, root=r.lora_path, parent=self.model_name, max_model_len=max_len)
            for name, r in self.adapters.items()
        ]
