"""DeepSeek-V3's MTP layer, loaded from the checkpoint's extra layer index (transformers drops
those weights, so the test writes them), against a forward written from the paper's
description with transformers' own decoder block."""

from __future__ import annotations

import math

import pytest
import torch

from support.deepseek_checkpoints import COMMON, make_deepseek, write_mtp_checkpoint
from tokenmill.attention_backends.torch_mla import TorchMLABackend
from tokenmill.forward_context import set_forward_context
from tokenmill.interfaces.attention import CommonAttentionMetadata
from tokenmill.layers.build_context import BuildContext
from tokenmill.layers.mla_attention import MLAAttention
from tokenmill.model_loader import load_hf_config, load_model
from tokenmill.models.deepseek_mtp import DeepSeekMTP
from tokenmill.models.deepseek_v2 import mtp_hf_config

BLOCK_SIZE = 8


def reference_mtp(hf, block, extra, input_ids, prev_hidden):
    """The MTP depth of the DeepSeek-V3 report: RMSNorm the next tokens' embeddings and the
    previous depth's hidden states, concatenate, project with ``eh_proj``, run one decoder
    block, then the shared head's norm and vocabulary projection."""
    eps = hf.config.rms_norm_eps

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    emb = hf.model.embed_tokens(input_ids)
    emb[0] = 0  # position 0 has no previous token
    x = torch.cat((rms(emb, extra["enorm.weight"]), rms(prev_hidden, extra["hnorm.weight"])), -1)
    x = (x @ extra["eh_proj.weight"].t())[None]
    positions = torch.arange(len(input_ids))[None]
    out = block(x, position_embeddings=hf.model.rotary_emb(x, positions), position_ids=positions)
    out = out[0] if isinstance(out, tuple) else out
    hidden = out[0]
    return hidden, rms(hidden, extra["shared_head.norm.weight"]) @ extra["shared_head.head.weight"].t()


def test_mtp_layer_matches_reference_forward(tmp_path):
    hf, block, extra = write_mtp_checkpoint(tmp_path)
    config = load_hf_config(tmp_path)
    assert config.num_nextn_predict_layers == 1
    main = load_model(tmp_path, config, BuildContext(TorchMLABackend), "cpu")  # skips the MTP layer
    mtp = load_model(tmp_path, mtp_hf_config(config), BuildContext(TorchMLABackend), "cpu")
    assert isinstance(mtp, DeepSeekMTP)
    assert sum(isinstance(m, MLAAttention) for m in mtp.modules()) == 1
    assert sum(isinstance(m, MLAAttention) for m in main.modules()) == config.num_hidden_layers

    n = 19
    gen = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, COMMON["vocab_size"], (n,), generator=gen)
    prev_hidden = torch.randn(n, COMMON["hidden_size"], generator=gen)
    with torch.inference_mode():
        ref_hidden, ref_logits = reference_mtp(hf, block, extra, input_ids, prev_hidden)

    attn = next(m for m in mtp.modules() if isinstance(m, MLAAttention))
    num_blocks = math.ceil(n / BLOCK_SIZE)
    attn.kv_cache = torch.zeros(TorchMLABackend.get_kv_cache_shape(num_blocks, BLOCK_SIZE, 1, attn.head_size))
    builder = TorchMLABackend.get_metadata_builder_cls()(attn.get_kv_cache_spec(BLOCK_SIZE, torch.float32), torch.device("cpu"))
    block_table = torch.arange(num_blocks, dtype=torch.int32)[None]
    qsl = torch.tensor([0, n], dtype=torch.int32)
    seq = torch.tensor([n], dtype=torch.int32)
    common = CommonAttentionMetadata(
        qsl, qsl, seq, seq, torch.tensor([0], dtype=torch.int32), block_table,
        torch.arange(n), 1, n, n, n,
    )
    positions = torch.arange(n)
    with torch.inference_mode(), set_forward_context(builder.build(common)):
        hidden = mtp(input_ids, positions, prev_hidden)
        logits = mtp.compute_logits(hidden)
    assert (hidden - ref_hidden).abs().max() < 1e-4
    assert (logits - ref_logits).abs().max() < 1e-4


def test_mtp_config_needs_mtp_layers(tmp_path):
    hf = make_deepseek("v3", num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="no MTP layers"):
        mtp_hf_config(hf.config)
