"""Token embedding and LM head with the vocabulary sharded over tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from tokenmill.layers.build_context import current_build_context
from tokenmill.layers.custom_op import CustomOp
from tokenmill.layers.linear import UnquantizedLinearMethod


class VocabParallelEmbedding(CustomOp):
    """Embedding whose rows (token ids) are split over TP ranks.

    The vocabulary is padded to a multiple of the TP size; rank ``r`` holds ids
    ``[r*n, (r+1)*n)``. Each rank looks up the ids it owns, zeroes the rest, and an all-reduce
    assembles the full embeddings. Padding rows stay zero.
    """

    op_name = "embedding"

    def __init__(self, num_embeddings: int, embedding_dim: int, prefix: str = "") -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.num_embeddings_padded = -(-num_embeddings // self.tp_size) * self.tp_size
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = nn.Parameter(
            torch.empty(
                self.num_embeddings_per_partition,
                embedding_dim,
                dtype=current_build_context().dtype,
            ),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"{self.prefix}: checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                f"expected {expected}"
            )
        shard = self._local_rows(loaded_weight)
        param.data[: shard.shape[0]].copy_(shard)
        param.data[shard.shape[0] :].zero_()

    def _local_rows(self, loaded_weight: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full-vocabulary tensor (fewer than a partition at the end)."""
        end = min(self.vocab_end_index, self.num_embeddings)
        return loaded_weight[self.vocab_start_index : end]

    def forward_native(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = torch.where(owned, input_ids - self.vocab_start_index, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(~owned.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings_per_partition}, "
            f"embedding_dim={self.embedding_dim}, tp_size={self.tp_size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection onto the (sharded) vocabulary.

    ``compute_logits`` multiplies by this rank's rows, all-gathers the vocabulary shards and
    returns float32 logits over the real (unpadded) vocabulary. ``tie_weights`` shares the
    embedding's weight instead of holding its own. The product is ``linear_method`` (whose
    weights the model loader processes once loaded): the quantization method's
    ``get_lm_head_method`` when it gives one, which then creates the head's weights (those it
    gives no ``weight_loader`` load this rank's vocabulary rows, as the float weight does), else
    the platform's unquantized one. A quantized head is tied only when its method loads a float
    ``weight`` like the embedding's (online quantization, which then quantizes the head's own
    copy); otherwise the checkpoint holds ``lm_head``'s tensors (GGUF).
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, bias: bool = False, prefix: str = ""
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, prefix)
        if bias:
            self.bias = nn.Parameter(
                torch.zeros(self.num_embeddings_per_partition, dtype=self.weight.dtype),
                requires_grad=False,
            )
            self.bias.weight_loader = self._bias_loader
        else:
            self.register_parameter("bias", None)
        ctx = current_build_context()
        method = ctx.quant_method.get_lm_head_method(self, prefix) if ctx.quant_method else None
        if method is not None:
            del self.weight
            method.create_weights(self, embedding_dim, [self.num_embeddings_per_partition], ctx.dtype)
            for param in self.parameters(recurse=False):
                if not hasattr(param, "weight_loader"):
                    param.weight_loader = self.weight_loader
        self.quantized = method is not None
        self.linear_method = method or UnquantizedLinearMethod.for_platform()

    def _bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        shard = self._local_rows(loaded_weight)
        param.data[: shard.shape[0]].copy_(shard)

    def process_weights_after_loading(self) -> None:
        self.linear_method.process_weights_after_loading(self)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> None:
        own = getattr(self, "weight", None)
        if self.quantized and (own is None or own.shape != embed_tokens.weight.shape):
            return
        if embed_tokens.weight.shape != self.weight.shape:
            raise ValueError(
                f"cannot tie {self.prefix} {tuple(self.weight.shape)} to embedding "
                f"{tuple(embed_tokens.weight.shape)}"
            )
        self.weight = embed_tokens.weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.linear_method.apply(self, hidden_states, self.bias)
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings].float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.prefix} is an LM head: call compute_logits(hidden_states)")
