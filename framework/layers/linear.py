"""Linear layers sharded for tensor parallelism (after vLLM's ``linear.py``).

Weights are stored ``[out_features, in_features]`` like ``nn.Linear``. A layer's parameters are
created by its :class:`~tokenmill.interfaces.quantization.LinearMethod` (the build context's
quantization method, or :class:`UnquantizedLinearMethod`) and each carries a
``weight_loader(param, loaded_weight[, shard_id])`` that copies this rank's slice of a checkpoint
tensor into place. Parameters mark their sharded dimensions with ``output_dim`` / ``input_dim``
attributes; a parameter without them is loaded whole.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from tokenmill.interfaces.quantization import LinearMethod
from tokenmill.layers.build_context import current_build_context, current_ops
from tokenmill.layers.lora import LoRAApply


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Attach loading metadata (``output_dim``, ``weight_loader``, ...) to a parameter."""
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"{name}: checkpoint tensor has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)


def _rank_slice(
    loaded: torch.Tensor, dim: int, full_size: int, index: int, size: int, name: str
) -> torch.Tensor:
    """Slice ``index`` (of width ``size``) of a checkpoint tensor whose ``dim`` is ``full_size``."""
    if loaded.shape[dim] != full_size:
        raise ValueError(
            f"{name}: checkpoint tensor has shape {tuple(loaded.shape)}, "
            f"expected {full_size} along dim {dim}"
        )
    return loaded.narrow(dim, index * size, size)


class UnquantizedLinearMethod(LinearMethod):
    """Plain ``x @ W.T + b`` in the model dtype."""

    @staticmethod
    def for_platform() -> LinearMethod:
        """The platform's ``unquantized_linear`` method (its op table's entry) if it has one,
        else this one."""
        return current_ops().get("unquantized_linear", UnquantizedLinearMethod)()

    def create_weights(
        self, layer: nn.Module, input_size: int, output_partition_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


def float_weight(layer: nn.Module) -> torch.Tensor:
    """``layer``'s weight ``[out, in]`` in float: the parameter itself when unquantized (or a
    plain ``nn.Linear``), else its linear method's ``dequantize``, computed on the first call
    after loading and kept (MLA folds ``kv_b_proj``'s weight into its queries and outputs, as
    vLLM dequantizes it)."""
    method = getattr(layer, "linear_method", None)
    if method is None or isinstance(method, UnquantizedLinearMethod):
        return layer.weight
    if (weight := getattr(layer, "dequantized_weight", None)) is None:
        weight = layer.dequantized_weight = layer.linear_method.dequantize(layer).float()
    return weight


class LinearBase(nn.Module):
    """Common setup: dtype, TP rank/size and the linear method from the build context.

    ``linear_method`` is the layer's :class:`LinearMethod`; once the checkpoint is in, the
    model loader calls the layer's :meth:`process_weights_after_loading`, which hands it on.
    ``lora``, set by the LoRA manager with ``enable_lora``, adds each token's adapter to the
    column- and row-parallel layers' output (before a row-parallel layer's all-reduce).
    """

    def __init__(self, input_size: int, output_size: int, prefix: str = "", quantize: bool = True) -> None:
        super().__init__()
        ctx = current_build_context()
        self.input_size = input_size
        self.output_size = output_size
        self.prefix = prefix
        self.params_dtype = ctx.dtype
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        method = None
        if ctx.quant_method is not None and quantize:
            method = ctx.quant_method.get_linear_method(self, prefix)
        self.linear_method: LinearMethod = method or UnquantizedLinearMethod.for_platform()
        self.lora: LoRAApply | None = None

    def process_weights_after_loading(self) -> None:
        self.linear_method.process_weights_after_loading(self)

    def _create_weights(
        self,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        bias: bool,
        bias_size: int,
        bias_sharded: bool,
    ) -> None:
        self.linear_method.create_weights(
            self, input_size_per_partition, output_partition_sizes, self.params_dtype
        )
        if bias:
            self.bias = nn.Parameter(
                torch.empty(bias_size, dtype=self.params_dtype), requires_grad=False
            )
            if bias_sharded:
                set_weight_attrs(self.bias, {"output_dim": 0})
        else:
            self.register_parameter("bias", None)
        for param in self.parameters(recurse=False):
            if not hasattr(param, "weight_loader"):
                param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's part of the full checkpoint tensor ``loaded_weight`` into ``param``."""
        raise NotImplementedError

    def _load_rank_part(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, dim_attr: str, full_size: int
    ) -> None:
        """Copy into ``param`` this rank's slice of ``loaded_weight`` along the dimension
        ``param`` names in ``dim_attr`` (``full_size`` wide in the checkpoint); whole when
        ``param`` has no such dimension (e.g. a replicated bias)."""
        dim = getattr(param, dim_attr, None)
        if dim is not None:
            loaded_weight = _rank_slice(
                loaded_weight, dim, full_size, self.tp_rank, param.shape[dim], self.prefix
            )
        _copy(param.data, loaded_weight, self.prefix)


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole; ``quantize=False`` keeps it float under any
    quantization method (a MoE router, whose logits the model computes in float32)."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, prefix: str = "", quantize: bool = True
    ) -> None:
        super().__init__(input_size, output_size, prefix, quantize)
        self._create_weights(input_size, [output_size], bias, output_size, bias_sharded=False)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        _copy(param.data, loaded_weight, self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """``Y = X A`` with ``A``'s output columns split over TP ranks: rank ``r`` computes
    ``Y[..., r*n:(r+1)*n]``. ``gather_output`` all-gathers the full ``Y``.

    ``output_sizes`` lists fused sub-matrices (subclasses); each is split over ranks on its own
    so every rank holds its slice of every sub-matrix, contiguously.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        prefix: str = "",
        output_sizes: list[int] | None = None,
    ) -> None:
        super().__init__(input_size, output_size, prefix)
        self.gather_output = gather_output
        self.output_size_per_partition = divide(output_size, self.tp_size)
        self.output_sizes = output_sizes or [output_size]
        self.output_partition_sizes = [divide(s, self.tp_size) for s in self.output_sizes]
        self._create_weights(
            input_size,
            self.output_partition_sizes,
            bias,
            self.output_size_per_partition,
            bias_sharded=True,
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        self._load_rank_part(param, loaded_weight, "output_dim", self.output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear_method.apply(self, x, self.bias)
        if self.lora is not None:
            self.lora(x, out)
        if self.gather_output and self.tp_size > 1:
            out = tensor_model_parallel_all_gather(out, dim=-1)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one GEMM
    (e.g. MLP gate and up: ``output_sizes=[intermediate, intermediate]``).

    The checkpoint stores them separately; ``weight_loader(param, w, shard_id)`` puts
    sub-matrix ``shard_id`` in place. ``shard_id=None`` loads an already fused tensor.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        gather_output: bool = False,
        prefix: str = "",
    ) -> None:
        super().__init__(
            input_size, sum(output_sizes), bias, gather_output, prefix, output_sizes=output_sizes
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | None = None
    ) -> None:
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            _copy(param.data, loaded_weight, self.prefix)
            return
        if shard_id is None:
            for i, part in enumerate(loaded_weight.split(self.output_sizes, dim=output_dim)):
                self.weight_loader(param, part, i)
            return
        offset = sum(self.output_partition_sizes[:shard_id])
        size = self.output_partition_sizes[shard_id]
        loaded_weight = _rank_slice(
            loaded_weight, output_dim, self.output_sizes[shard_id], self.tp_rank, size, self.prefix
        )
        _copy(param.data.narrow(output_dim, offset, size), loaded_weight, self.prefix)


class QKVParallelLinear(ColumnParallelLinear):
    """The fused query/key/value projection of an attention layer, split by heads.

    Each rank holds ``total_num_heads / tp`` query heads and ``total_num_kv_heads / tp`` KV
    heads, laid out ``[q | k | v]``. When ``tp > total_num_kv_heads`` every KV head is
    replicated on ``tp / total_num_kv_heads`` ranks so each rank still holds one.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        prefix: str = "",
    ) -> None:
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= self.total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, self.total_num_kv_heads)
        else:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        q_size = self.num_heads * head_size * tp_size
        kv_size = self.num_kv_heads * head_size * tp_size
        super().__init__(
            hidden_size,
            q_size + 2 * kv_size,
            bias,
            gather_output=False,
            prefix=prefix,
            output_sizes=[q_size, kv_size, kv_size],
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | None = None
    ) -> None:
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            _copy(param.data, loaded_weight, self.prefix)
            return
        if shard_id is None:
            q = self.total_num_heads * self.head_size
            kv = self.total_num_kv_heads * self.head_size
            for sid, part in zip("qkv", loaded_weight.split([q, kv, kv], dim=output_dim)):
                self.weight_loader(param, part, sid)
            return
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"{self.prefix}: shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        index = "qkv".index(shard_id)
        offset = sum(self.output_partition_sizes[:index])
        size = self.output_partition_sizes[index]
        if shard_id == "q":
            shard_rank, full_size = self.tp_rank, self.total_num_heads * self.head_size
        else:
            shard_rank = self.tp_rank // self.num_kv_head_replicas
            full_size = self.total_num_kv_heads * self.head_size
        loaded_weight = _rank_slice(
            loaded_weight, output_dim, full_size, shard_rank, size, self.prefix
        )
        _copy(param.data.narrow(output_dim, offset, size), loaded_weight, self.prefix)


class RowParallelLinear(LinearBase):
    """``Y = X A`` with ``A``'s input rows split over TP ranks: each rank multiplies its slice
    of ``X`` and the partial products are summed by an all-reduce. The bias is added on rank 0
    only, so it counts once in the sum.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_size, prefix)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self._create_weights(
            self.input_size_per_partition, [output_size], bias, output_size, bias_sharded=False
        )

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        self._load_rank_part(param, loaded_weight, "input_dim", self.input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = x.chunk(self.tp_size, dim=-1)[self.tp_rank]
        bias = self.bias if self.tp_rank == 0 else None
        out = self.linear_method.apply(self, x, bias)
        if self.lora is not None:
            self.lora(x, out)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
