"""Weights moved onto huge pages (``platforms/cpu_memory.py``): one 2 MiB-aligned mapping, the
same values, ties and views kept, buffers left where they are, a parameter another model moved
left there, huge pages where the kernel allows them, and the engine's model moved with its
answers unchanged."""

from __future__ import annotations

import mmap
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import make_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.platforms.cpu import CpuPlatform
from tokenmill.platforms.cpu_memory import HUGE_PAGE, move_to_huge_pages

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no huge-page advice on this OS")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, 64)
        self.head = nn.Linear(64, 512, bias=False)
        self.head.weight = self.embed.weight
        self.up = nn.Linear(64, 8192)
        self.register_buffer("table", torch.randn(300, 7))
        self.top = nn.Parameter(self.up.weight.detach()[:4096], requires_grad=False)


def _mapping(ptr: int) -> tuple[int, int, str]:
    """The /proc/self/smaps entry holding address ``ptr``: its start, end and text."""
    entries = re.split(r"^(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text(), flags=re.M)
    for entry in filter(None, entries):
        start, end = (int(x, 16) for x in entry.split(maxsplit=1)[0].split("-"))
        if start <= ptr < end:
            return start, end, entry
    raise AssertionError(f"{ptr:#x} in no mapping")


def test_weights_move_into_one_aligned_mapping_with_values_ties_and_views_kept():
    torch.manual_seed(0)
    model = Tied()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    up_weight = model.up.weight
    table_ptr = model.table.data_ptr()
    moved = move_to_huge_pages(model)
    assert moved >= sum(t.nbytes for t in model.parameters()) - model.top.nbytes
    assert model.table.data_ptr() == table_ptr
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
    assert model.head.weight is model.embed.weight
    assert model.up.weight is up_weight
    first = min(t.data_ptr() for t in model.parameters())
    assert first % HUGE_PAGE == 0
    start, end, _ = _mapping(first)
    assert all(start <= t.data_ptr() < end for t in model.parameters())
    assert model.top.data_ptr() == model.up.weight.data_ptr()
    model.up.weight.data[0, 0] = 123.0
    assert model.top[0, 0] == 123.0
    x = torch.randint(0, 512, (5,))
    table = before["embed.weight"]
    assert torch.equal(model.head(model.embed(x)), nn.functional.linear(table[x], table))


def test_a_second_model_leaves_a_parameter_it_shares_where_the_first_moved_it():
    target = Tied()
    move_to_huge_pages(target)
    head = nn.Module()
    head.embed = target.embed
    head.fc = nn.Linear(128, 64)
    embed_ptr = target.embed.weight.data_ptr()
    assert move_to_huge_pages(head) == head.fc.weight.nbytes + head.fc.bias.nbytes
    assert target.embed.weight.data_ptr() == embed_ptr
    assert head.fc.weight.data_ptr() % HUGE_PAGE == 0


def _huge_pages_allowed() -> bool:
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in setting


@pytest.mark.skipif(not _huge_pages_allowed(), reason="transparent huge pages are off on this machine")
def test_the_moved_weights_lie_on_huge_pages():
    model = nn.Linear(1024, 4096)
    move_to_huge_pages(model)
    _, _, smaps = _mapping(model.weight.data_ptr())
    huge_kb = next(int(line.split()[1]) for line in smaps.splitlines() if line.startswith("AnonHugePages:"))
    assert huge_kb >= 2048, smaps


def _run(checkpoint: str) -> tuple[nn.Module, list]:
    llm = LLM(model=checkpoint, block_size=8, max_model_len=128, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 9]}], params, use_tqdm=False)[0].outputs[0]
    return llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model, [out.token_ids, out.logprobs]


def test_the_engine_moves_its_model_and_answers_as_before(tmp_path, monkeypatch):
    checkpoint = make_tiny_checkpoint(tmp_path, "llama")
    model, moved = _run(checkpoint)
    start, end, _ = _mapping(next(model.parameters()).data_ptr())
    first = min(t.data_ptr() for t in model.parameters())
    assert first % HUGE_PAGE == 0 and start <= first
    assert all(t.data_ptr() < end for t in model.parameters())
    monkeypatch.setattr(CpuPlatform, "place_weights", classmethod(lambda cls, model: None))
    model, as_loaded = _run(checkpoint)
    assert not any(start <= p.data_ptr() < end for p in model.parameters())
    assert moved == as_loaded
