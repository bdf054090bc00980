"""The LoRA part of a linear layer: every token's own adapter in one batched call.

Adapters live in ``max_loras`` fixed slots. A layer whose output is made of ``S`` slices
(``[q | k | v]``, ``[gate | up]``, or one) keeps, for every slot, ``S`` stacked ``A`` matrices
(``max_lora_rank`` rows each, zero-padded) and their ``B`` matrices placed block-diagonally
over the output columns, so that per step

    out += ((x @ A_all.T) * onehot(slot)) @ B_all

adds every token's adapter with two GEMMs whatever the mix (the shrink and expand of punica's
BGMV). The one-hot mask (:class:`LoRAMapping`, one per model, set once per step) is zero for
tokens with no adapter and covers only the slots up to the highest one in use. That is the
torch path (``forward_native``); the platforms' kernels (C on the CPU, Triton on GPUs) read
each token's slot instead and only the first ``slice_ranks[slot, slice]`` rows of a slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.custom_op import CustomOp


@dataclass
class LoRAMapping:
    """Which slot each token of the step uses, shared by every LoRA layer of a model.

    ``onehot`` is ``[T, width]`` in the model dtype (``onehot[t, s] = 1`` when token ``t``
    uses slot ``s``) and ``token_slots`` ``[T]`` int64 (token ``t``'s slot, -1 for none); both
    None when no token of the step uses an adapter."""

    onehot: torch.Tensor | None = None
    token_slots: torch.Tensor | None = None


class LoRAApply(CustomOp):
    """Adds the slot adapters' ``x @ A.T @ B.T`` to a linear layer's output, in place.

    ``output_slices`` are the widths of the layer's fused outputs on this rank."""

    op_name = "lora_apply"

    def __init__(
        self,
        mapping: LoRAMapping,
        max_loras: int,
        max_rank: int,
        input_size: int,
        output_slices: list[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.mapping = mapping
        self.max_rank = max_rank
        self.output_slices = list(output_slices)
        self.slot_rows = len(output_slices) * max_rank
        rows = max_loras * self.slot_rows
        self.register_buffer(
            "lora_a", torch.zeros(rows, input_size, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "lora_b", torch.zeros(rows, sum(output_slices), dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "slice_ranks",
            torch.zeros(max_loras, len(output_slices), dtype=torch.int64, device=device),
            persistent=False,
        )
        """Per slot and output slice, the adapter's rank there (0: it leaves the slice alone)."""
        offsets = [0]
        for width in output_slices:
            offsets.append(offsets[-1] + width)
        self.register_buffer(
            "slice_offsets", torch.tensor(offsets, dtype=torch.int64, device=device), persistent=False
        )
        """The output columns where each slice starts, and the total width."""

    def set_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Put one adapter in ``slot``: per output slice its ``(A [r, in], B [out, r])`` (the
        scaling folded into ``B``), or None where the adapter leaves the slice alone."""
        base = slot * self.slot_rows
        self.lora_a[base : base + self.slot_rows].zero_()
        self.lora_b[base : base + self.slot_rows].zero_()
        self.slice_ranks[slot].copy_(torch.tensor([0 if p is None else p[0].shape[0] for p in weights]))
        offset = 0
        for i, (width, pair) in enumerate(zip(self.output_slices, weights)):
            if pair is not None:
                a, b = pair
                rank = a.shape[0]
                start = base + i * self.max_rank
                self.lora_a[start : start + rank].copy_(a)
                self.lora_b[start : start + rank, offset : offset + width].copy_(b.T)
            offset += width

    def forward_native(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out [T, out] += `` each token's slot adapter applied to ``x [T, in]``."""
        onehot = self.mapping.onehot
        if onehot is None:
            return
        width = onehot.shape[1]
        rows = width * self.slot_rows
        shrunk = x @ self.lora_a[:rows].T
        shrunk = shrunk.view(-1, width, self.slot_rows).mul_(onehot.unsqueeze(2)).view(-1, rows)
        out.addmm_(shrunk, self.lora_b[:rows])
