"""Rotary position embeddings with a cos/sin cache indexed by token position."""

from __future__ import annotations

import math
from typing import Any

import torch
from tokenmill.layers.build_context import current_ops
from tokenmill.layers.custom_op import CustomOp


class RotaryEmbedding(CustomOp):
    """Applies RoPE to flat ``q`` [T, H*D] and ``k`` [T, KVH*D] at ``positions`` [T].

    The first ``rotary_dim`` features of each head rotate; the rest pass through.
    ``is_neox_style`` rotates the two halves of those features (Llama, GPT-NeoX); otherwise
    interleaved pairs (GPT-J). As in vLLM, ``forward`` may rotate ``q`` and ``k`` in place (the
    CPU kernel does): use the returned tensors.
    """

    op_name = "rotary_embedding"

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.base = base
        self.is_neox_style = is_neox_style
        self.register_buffer("cos_sin_cache", self._compute_cos_sin_cache(), persistent=False)

    def _compute_inv_freq(self) -> torch.Tensor:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
        return 1.0 / (self.base**exponents)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        """[max_position, rotary_dim]: cos of every frequency, then sin."""
        inv_freq = self._compute_inv_freq()
        t = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, n*head_size]; ``cos``/``sin`` are [T, 1, rotary_dim/2]. Writes into
        one output tensor with fused multiply-adds (no intermediate concatenations)."""
        shape = x.shape
        x = x.view(shape[0], -1, self.head_size)
        out = torch.empty_like(x)
        half = self.rotary_dim // 2
        if self.is_neox_style:
            x1, x2 = x[..., :half], x[..., half : self.rotary_dim]
            o1, o2 = out[..., :half], out[..., half : self.rotary_dim]
        else:
            x1, x2 = x[..., 0 : self.rotary_dim : 2], x[..., 1 : self.rotary_dim : 2]
            o1, o2 = out[..., 0 : self.rotary_dim : 2], out[..., 1 : self.rotary_dim : 2]
        torch.mul(x1, cos, out=o1)
        o1.addcmul_(x2, sin, value=-1)
        torch.mul(x2, cos, out=o2)
        o2.addcmul_(x1, sin)
        if self.rotary_dim < self.head_size:
            out[..., self.rotary_dim :] = x[..., self.rotary_dim :]
        return out.view(shape)

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(query.dtype).unsqueeze(-2)
        half = self.rotary_dim // 2
        cos, sin = cos_sin[..., :half], cos_sin[..., half:]
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"max_position={self.max_position}, base={self.base}, neox={self.is_neox_style}"
        )


class LinearScalingRotaryEmbedding(RotaryEmbedding):
    """Positions divided by ``factor`` (position interpolation)."""

    def __init__(self, *args: Any, factor: float, **kwargs: Any) -> None:
        self.factor = factor
        super().__init__(*args, **kwargs)

    def _compute_inv_freq(self) -> torch.Tensor:
        return super()._compute_inv_freq() / self.factor


class Llama3RotaryEmbedding(RotaryEmbedding):
    """Llama 3.1 frequency scaling: long wavelengths slowed by ``factor``, short ones kept,
    a smooth blend between ``low_freq_factor`` and ``high_freq_factor``."""

    def __init__(
        self,
        *args: Any,
        factor: float,
        low_freq_factor: float,
        high_freq_factor: float,
        original_max_position_embeddings: int,
        **kwargs: Any,
    ) -> None:
        self.factor = factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.original_max_position = original_max_position_embeddings
        super().__init__(*args, **kwargs)

    def _compute_inv_freq(self) -> torch.Tensor:
        inv_freq = super()._compute_inv_freq()
        low_freq_wavelen = self.original_max_position / self.low_freq_factor
        high_freq_wavelen = self.original_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        if self.low_freq_factor != self.high_freq_factor:
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
        else:
            smooth = torch.zeros_like(inv_freq)
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        return torch.where(
            wavelen < high_freq_wavelen,
            inv_freq,
            torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, blended),
        )


class YaRNScalingRotaryEmbedding(RotaryEmbedding):
    """YaRN (as HF's ``yarn`` rope type and DeepSeek's scaling): frequencies blended between
    interpolated (``/ factor``) and original by a linear ramp over the correction range of
    ``beta_fast``/``beta_slow`` rotations, and cos/sin multiplied by ``attention_factor``
    (by default ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``)."""

    def __init__(
        self,
        *args: Any,
        factor: float,
        original_max_position_embeddings: int,
        beta_fast: float | None = None,
        beta_slow: float | None = None,
        mscale: float | None = None,
        mscale_all_dim: float | None = None,
        attention_factor: float | None = None,
        truncate: bool = True,
        **kwargs: Any,
    ) -> None:
        self.factor = factor
        self.original_max_position = original_max_position_embeddings
        self.beta_fast = beta_fast or 32
        self.beta_slow = beta_slow or 1
        self.truncate = truncate
        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(
                    factor, mscale_all_dim
                )
            else:
                attention_factor = yarn_get_mscale(factor)
        self.attention_factor = float(attention_factor)
        super().__init__(*args, **kwargs)

    def _correction_dim(self, num_rotations: float) -> float:
        return (
            self.rotary_dim
            * math.log(self.original_max_position / (num_rotations * 2 * math.pi))
            / (2 * math.log(self.base))
        )

    def _compute_inv_freq(self) -> torch.Tensor:
        pos_freqs = self.base ** (
            torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
        )
        low, high = self._correction_dim(self.beta_fast), self._correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.rotary_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(self.rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return (1.0 / (self.factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        return super()._compute_cos_sin_cache() * self.attention_factor


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1·mscale·ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_config(config: Any) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from a HF config of any transformers version.

    transformers >= 5 keeps everything in ``config.rope_parameters`` (``rope_theta``,
    ``rope_type`` and the scaling keys); older versions use ``config.rope_theta`` and
    ``config.rope_scaling``. ``rope_scaling`` is None for plain RoPE.
    """
    params = getattr(config, "rope_parameters", None)
    if params:
        scaling = dict(params)
        theta = scaling.pop("rope_theta", None) or getattr(config, "rope_theta", None)
    else:
        scaling = dict(getattr(config, "rope_scaling", None) or {})
        theta = getattr(config, "rope_theta", None)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return float(theta or 10000.0), (None if rope_type == "default" else scaling)


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    is_neox_style: bool = True,
) -> RotaryEmbedding:
    """A rotary embedding for the given settings, shared by every layer that asks for the same
    settings on the same device with the same op (the cos/sin cache can be large)."""
    scaling = dict(rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    key = (
        head_size,
        rotary_dim,
        max_position,
        base,
        tuple(sorted((k, str(v)) for k, v in scaling.items())),
        is_neox_style,
        str(torch.get_default_device()),
        current_ops().get(RotaryEmbedding.op_name),
    )
    if key in _ROPE_CACHE:
        return _ROPE_CACHE[key]
    args = (head_size, rotary_dim, max_position, base, is_neox_style)
    if rope_type == "default":
        rope = RotaryEmbedding(*args)
    elif rope_type == "linear":
        rope = LinearScalingRotaryEmbedding(*args, factor=scaling["factor"])
    elif rope_type == "llama3":
        rope = Llama3RotaryEmbedding(
            *args,
            factor=scaling["factor"],
            low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
            original_max_position_embeddings=scaling["original_max_position_embeddings"],
        )
    elif rope_type == "yarn":
        keys = (
            "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"
        )
        rope = YaRNScalingRotaryEmbedding(
            *args,
            factor=scaling["factor"],
            original_max_position_embeddings=scaling["original_max_position_embeddings"],
            **{k: scaling[k] for k in keys if scaling.get(k) is not None},
        )
    else:
        raise NotImplementedError(
            f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3, yarn"
        )
    _ROPE_CACHE[key] = rope
    return rope
