"""Multi-LoRA serving: PEFT adapters over the base model, many per batch (after vLLM's
``vllm.lora``). ``LoRARequest`` names an adapter; ``adapter`` reads and checks a PEFT
checkpoint; ``manager`` keeps the worker's adapters in slots and maps each step's tokens to them."""

from tokenmill.lora.request import LoRARequest

__all__ = ["LoRARequest"]
