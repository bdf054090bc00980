"""The worker's adapters: the model's LoRA layers, an LRU of ``max_cpu_loras`` adapters read
into host memory, and the ``max_loras`` slots the layers compute with (vLLM's LoRA model
manager and punica wrapper in one)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from tokenmill.config import EngineConfig
from tokenmill.layers.linear import ColumnParallelLinear, RowParallelLinear
from tokenmill.layers.lora import LoRAApply, LoRAMapping
from tokenmill.lora.adapter import LoRAWeights, load_adapter
from tokenmill.lora.request import LoRARequest

PACKED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "o_proj": ("o_proj",),
    "down_proj": ("down_proj",),
}
"""The model's (fused) linear layers an adapter reaches -> the PEFT modules of their slices."""


class LoRAManager:
    """Gives every LoRA-capable linear layer of ``model`` its :class:`LoRAApply` (built in the
    caller's build context, so the platform's ``lora_apply`` op applies) and keeps the slots.

    Per step, :meth:`set_step` puts the step's adapters in slots (loading from the host LRU,
    or from disk when the LRU dropped one) and sets the token-to-slot mapping."""

    def __init__(self, model: nn.Module, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.dtype = config.torch_dtype
        self.mapping = LoRAMapping()
        self.layers: list[tuple[LoRAApply, list[str]]] = []
        """Each LoRA layer and the PEFT module paths of its output slices."""
        for name, module in model.named_modules():
            prefix, _, leaf = name.rpartition(".")
            slices = PACKED_MODULES.get(leaf)
            if slices is None or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            widths = list(getattr(module, "output_partition_sizes", [module.output_size]))
            if len(widths) != len(slices):
                raise ValueError(f"enable_lora: {name} has {len(widths)} output slices, expected {len(slices)}")
            in_features = getattr(module, "input_size_per_partition", module.input_size)
            module.lora = LoRAApply(
                self.mapping, config.max_loras, config.max_lora_rank, in_features, widths, self.dtype, device
            )
            self.layers.append((module.lora, [f"{prefix}.{s}" for s in slices]))
        num_layers = config.hf_config.num_hidden_layers
        if len(self.layers) != len(PACKED_MODULES) * num_layers:
            raise ValueError(
                f"enable_lora: model {type(model).__name__} does not have the Llama family's "
                f"qkv_proj, o_proj, gate_up_proj and down_proj in each of its {num_layers} "
                f"layers; LoRA covers those projections only"
            )
        self.known: dict[int, LoRARequest] = {}
        self.host: OrderedDict[int, LoRAWeights] = OrderedDict()
        self.slots: list[int | None] = [None] * config.max_loras
        self.slot_last_used = [0] * config.max_loras
        self.num_steps = 0

    def add_adapter(self, request: LoRARequest) -> None:
        """Note a request's adapter and read it into the host LRU if it is not there."""
        known = self.known.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is {known.lora_name!r} ({known.lora_path}); "
                f"it cannot also name {request.lora_name!r} ({request.lora_path})"
            )
        self.known[request.lora_int_id] = request
        self._host_weights(request.lora_int_id)

    def _host_weights(self, lora_id: int) -> LoRAWeights:
        weights = self.host.get(lora_id)
        if weights is not None:
            self.host.move_to_end(lora_id)
            return weights
        weights = load_adapter(self.known[lora_id], self.config.hf_config, self.config.max_lora_rank)
        self.host[lora_id] = weights
        while len(self.host) > self.config.max_cpu_loras:
            self.host.popitem(last=False)
        return weights

    def set_step(self, token_lora_ids: np.ndarray) -> None:
        """Map the step's tokens (``token_lora_ids[t]``: the ``lora_int_id`` of token ``t``'s
        request, 0 for none) to slots, swapping adapters in where needed."""
        self.num_steps += 1
        ids = [int(i) for i in np.unique(token_lora_ids) if i > 0]
        if not ids:
            self.mapping.onehot = self.mapping.token_slots = None
            return
        if len(ids) > len(self.slots):
            raise RuntimeError(f"{len(ids)} adapters in one step; max_loras={len(self.slots)}")
        token_slots = np.full(len(token_lora_ids), -1, dtype=np.int64)
        for lora_id in ids:
            slot = self._slot_of(lora_id, ids)
            self.slot_last_used[slot] = self.num_steps
            token_slots[token_lora_ids == lora_id] = slot
        used = np.flatnonzero(token_slots >= 0)
        onehot = torch.zeros(len(token_slots), int(token_slots.max()) + 1, dtype=self.dtype)
        onehot[torch.from_numpy(used), torch.from_numpy(token_slots[used])] = 1
        self.mapping.onehot = onehot.to(self.device)
        self.mapping.token_slots = torch.from_numpy(token_slots).to(self.device)

    def _slot_of(self, lora_id: int, step_ids: list[int]) -> int:
        """The slot holding ``lora_id``, after loading it into a free slot or the least
        recently used one no adapter of this step holds."""
        if lora_id in self.slots:
            return self.slots.index(lora_id)
        free = [s for s, held in enumerate(self.slots) if held is None or held not in step_ids]
        slot = min(free, key=lambda s: (self.slots[s] is not None, self.slot_last_used[s]))
        weights = self._host_weights(lora_id)
        for layer, modules in self.layers:
            layer.set_slot(slot, [self._on_device(weights.modules.get(m)) for m in modules])
        self.slots[slot] = lora_id
        return slot

    def _on_device(
        self, pair: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if pair is None:
            return None
        return tuple(t.to(device=self.device, dtype=self.dtype) for t in pair)
