"""CUDA-graph replay of decode steps equals the eager forward, for every graph-capable backend
that can serve here; and a step that is not decode-only, or too large, is left to eager."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_checkpoint
from support.paged_batches import usable_backend
from tokenmill.config import EngineConfig
from tokenmill.config_resolver import resolve_config
from tokenmill.forward_context import set_forward_context
from tokenmill.interfaces.attention import CommonAttentionMetadata
from tokenmill.interfaces.decode_graph import capture_sizes
from tokenmill.platforms.cuda_graph import CudaGraphRunner
from tokenmill.worker.model_runner import ModelRunner

BLOCKS_PER_REQ = 4
# (backend, dtype, block_size, atol)
CASES = [
    ("triton", "float32", 16, 1e-3),
    ("triton", "bfloat16", 16, 5e-2),
    ("flashinfer", "bfloat16", 16, 5e-2),
    ("flash_attn", "bfloat16", 256, 5e-2),
]


def test_capture_sizes():
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1000)[-3:] == [240, 248, 256]


def _common(seq_lens: list[int], query_lens: list[int], block_size: int) -> CommonAttentionMetadata:
    """Request ``i`` owns blocks ``i*BLOCKS_PER_REQ ...``; its query tokens end its sequence."""
    device = "cuda"
    num_reqs = len(seq_lens)
    block_table = torch.arange(num_reqs * BLOCKS_PER_REQ, dtype=torch.int32).view(num_reqs, -1)
    slots = []
    for i, (s, q) in enumerate(zip(seq_lens, query_lens)):
        pos = torch.arange(s - q, s)
        slots.append(block_table[i, pos // block_size].long() * block_size + pos % block_size)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq.to(device),
        seq_lens_cpu=seq,
        num_computed_tokens_cpu=seq - torch.tensor(query_lens, dtype=torch.int32),
        block_table=block_table.to(device),
        slot_mapping=torch.cat(slots).to(device),
        num_reqs=num_reqs,
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def _inputs(seq_lens: list[int], query_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens)])
    input_ids = (positions * 7 + 3) % 256
    return input_ids.cuda(), positions.cuda()


def _eager(
    runner: ModelRunner, common: CommonAttentionMetadata, input_ids, positions
) -> torch.Tensor:
    metadata = runner.metadata_builder.build(common)
    with set_forward_context(metadata):
        return runner.model(input_ids, positions)


@pytest.mark.gpu
@pytest.mark.parametrize("name, dtype, block_size, atol", CASES)
@torch.inference_mode()
def test_replay_equals_eager(tmp_path, name, dtype, block_size, atol):
    usable_backend(name, 64, getattr(torch, dtype), block_size)
    model = make_tiny_checkpoint(
        tmp_path,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config = resolve_config(EngineConfig(
        model=model,
        attention_backend=name,
        dtype=dtype,
        block_size=block_size,
        max_num_seqs=8,
        max_model_len=BLOCKS_PER_REQ * block_size,
    ))
    runner = ModelRunner(config, torch.device("cuda", 0))
    runner.load_model()
    runner.initialize_kv_cache(8 * BLOCKS_PER_REQ)
    graphs = CudaGraphRunner(
        runner.model,
        runner.metadata_builder,
        [1, 2, 4, 8],
        BLOCKS_PER_REQ,
        config.max_model_len,
        runner.device,
        tokens_per_request=3,
    )

    prompt_lens = [5, 17, 9, 30, 2]
    prefill = _common(prompt_lens, prompt_lens, block_size)
    _eager(runner, prefill, *_inputs(prompt_lens, prompt_lens))
    graphs.capture()
    assert graphs.run(*_inputs(prompt_lens, prompt_lens), prefill) is None

    for n in (3, 5, 1):  # padded to 4, 8 and exact 1; contexts grow between steps
        seq_lens = [p + 1 for p in prompt_lens[:n]]
        decode = _common(seq_lens, [1] * n, block_size)
        inputs = _inputs(seq_lens, [1] * n)
        eager = _eager(runner, decode, *inputs).clone()
        replayed = graphs.run(*inputs, decode)
        assert replayed is not None and replayed.shape == eager.shape
        assert (replayed.float() - eager.float()).abs().max().item() <= atol
        prompt_lens[:n] = seq_lens

    # A verification's shape (several tokens per request) replays each token as a decode row.
    seq_lens = [p + q for p, q in zip(prompt_lens[:2], (3, 2))]
    verify = _common(seq_lens, [3, 2], block_size)
    inputs = _inputs(seq_lens, [3, 2])
    eager = _eager(runner, verify, *inputs).clone()
    replayed = graphs.run(*inputs, verify)
    assert replayed is not None and replayed.shape == eager.shape
    assert (replayed.float() - eager.float()).abs().max().item() <= atol
    prompt_lens[:2] = seq_lens

    too_many = [p + 1 for p in prompt_lens] * 2
    assert graphs.run(*_inputs(too_many, [1] * 10), _common(too_many, [1] * 10, block_size)) is None
