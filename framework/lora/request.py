"""The request for one LoRA adapter (vLLM's ``vllm.lora.request.LoRARequest``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter to generate with.

    ``lora_name`` names it (in the server, the ``model`` a request asks for); ``lora_int_id``
    (>= 1) identifies it inside the engine: requests with equal ids share the adapter's slot
    and prefix-cache blocks, so one id must always mean one adapter; ``lora_path`` is the
    directory holding ``adapter_config.json`` and ``adapter_model.safetensors``."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(
                f"LoRA adapter {self.lora_name!r}: lora_int_id must be an integer >= 1, "
                f"got {self.lora_int_id!r}"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path must be a non-empty string")
