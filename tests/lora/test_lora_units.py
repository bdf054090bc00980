"""LoRA parts on their own: the batched ``lora_apply`` op against a per-row loop, PEFT
checkpoint checks, the scheduler's adapter limit, the configuration's refusals."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_cache_utils import make_block_hasher
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler, SchedulerConfig
from tokenmill.layers.lora import LoRAApply, LoRAMapping
from tokenmill.lora.adapter import load_adapter
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams


def _loop_reference(x, slots, adapters, widths):
    """Row by row: ``x[t] @ A.T @ B.T`` of the row's adapter, slice by slice."""
    out = torch.zeros(x.shape[0], sum(widths), dtype=torch.float64)
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        offset = 0
        for width, pair in zip(widths, adapters[slot]):
            if pair is not None:
                a, b = pair
                out[t, offset : offset + width] = (x[t].double() @ a.double().T) @ b.double().T
            offset += width
    return out


def _set_mapping(mapping: LoRAMapping, slots: list[int]) -> None:
    """The step mapping of ``slots`` (-1: no adapter), as ``LoRAManager.set_step`` sets it."""
    onehot = torch.zeros(len(slots), max(slots) + 1)
    for t, s in enumerate(slots):
        if s >= 0:
            onehot[t, s] = 1
    mapping.onehot, mapping.token_slots = onehot, torch.tensor(slots, dtype=torch.int64)


def _triton_bgmv(layer: LoRAApply, x: torch.Tensor, out: torch.Tensor) -> None:
    """The CUDA platform's Triton kernel, on the GPU when there is one, else under the
    interpreter on the CPU (conftest sets ``TRITON_INTERPRET``)."""
    triton = pytest.importorskip("triton")
    if not torch.cuda.is_available() and type(triton.language.sum).__name__ != "InterpretedFunction":
        raise RuntimeError("triton was imported without TRITON_INTERPRET=1 on a machine without a GPU")
    from tokenmill.platforms.cuda_lora import lora_bgmv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    moved = [t.to(device) for t in (out, x, layer.lora_a, layer.lora_b, layer.mapping.token_slots,
                                     layer.slice_ranks, layer.slice_offsets)]
    lora_bgmv(*moved, layer.max_rank, max(layer.output_slices))
    out.copy_(moved[0].cpu())


def _build(impl: str, *args) -> LoRAApply:
    if impl == "cpu_c":
        from tokenmill.attention_backends.torch_ref import TorchRefBackend
        from tokenmill.layers.build_context import BuildContext, model_build_context
        from tokenmill.platforms.cpu import CpuPlatform

        ops = CpuPlatform.get_ops()
        assert "lora_apply" in ops, "the C kernels should build on this machine"
        with model_build_context(BuildContext(TorchRefBackend, ops=ops)):
            return LoRAApply(*args)
    return LoRAApply(*args)


@pytest.mark.parametrize("impl", ["torch", "cpu_c", "triton"])
@pytest.mark.parametrize("widths", [[37], [41, 13, 13], [29, 29]])
def test_lora_apply_matches_per_row_loop(widths, impl, monkeypatch):
    """Ranks 8-64 (and 17, 33: not multiples of the kernels' blocks), odd sizes, slices an
    adapter leaves alone, tokens without an adapter, rows interleaved and in runs of one
    adapter, a strided output; each implementation:
    the torch path, the CPU platform's C kernel, the CUDA platform's Triton kernel."""
    from tokenmill.ops import cpu as cpu_ops

    calls = []
    c_kernel = cpu_ops.lora_apply
    monkeypatch.setattr(cpu_ops, "lora_apply", lambda *a: calls.append(1) or c_kernel(*a))
    torch.manual_seed(0)
    max_loras, max_rank, in_features, tokens = 4, 64, 53, 23
    ranks = [8, 64, 17, 33]
    mapping = LoRAMapping()
    layer = _build(impl, mapping, max_loras, max_rank, in_features, widths, torch.float32, torch.device("cpu"))
    apply = (lambda x, out: _triton_bgmv(layer, x, out)) if impl == "triton" else layer
    adapters = []
    for slot, rank in enumerate(ranks):
        pairs = [
            None if (slot + i) % 3 == 2 else (torch.randn(rank, in_features), torch.randn(w, rank))
            for i, w in enumerate(widths)
        ]
        layer.set_slot(slot, pairs)
        adapters.append(pairs)
    x = torch.randn(tokens, in_features)
    slots = [(t * 7) % 6 - 1 for t in range(tokens)]  # slots -1..4: -1 is the base model
    slots = [s if s < max_loras else -1 for s in slots]
    assert -1 in slots and set(range(max_loras)) <= set(slots)
    # Runs of one slot as a prefill makes them (1 to 9 rows: full and partial tiles of the
    # kernels' grouping), next to the interleaved rows of a decode step.
    runs = [(0, 1), (1, 6), (-1, 3), (2, 9), (3, 2), (1, 2)]
    segments = [slot for slot, length in runs for _ in range(length)]
    assert len(segments) == tokens
    for used in (slots, [s if s in (-1, 1) else -1 for s in slots], segments):
        _set_mapping(mapping, used)
        base = torch.randn(tokens, sum(widths))
        out = torch.randn(tokens, sum(widths) + 5)[:, 2 : 2 + sum(widths)]  # rows strided
        out.copy_(base)
        apply(x, out)
        expected = base.double() + _loop_reference(x, used, adapters, widths)
        torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-3)
    assert len(calls) == (3 if impl == "cpu_c" else 0)
    if impl != "triton":
        mapping.onehot = mapping.token_slots = None
        out = base.clone()
        layer(x, out)
        assert torch.equal(out, base)


def test_set_slot_replaces_the_previous_adapter():
    mapping = LoRAMapping(torch.ones(2, 1))
    layer = LoRAApply(mapping, 1, 8, 5, [3, 4], torch.float32, torch.device("cpu"))
    layer.set_slot(0, [(torch.randn(8, 5), torch.randn(3, 8)), (torch.randn(8, 5), torch.randn(4, 8))])
    a, b = torch.randn(2, 5), torch.randn(4, 2)
    layer.set_slot(0, [None, (a, b)])
    x, out = torch.randn(2, 5), torch.zeros(2, 7)
    layer(x, out)
    assert torch.equal(out[:, :3], torch.zeros(2, 3))
    torch.testing.assert_close(out[:, 3:], x @ a.T @ b.T)


HF = SimpleNamespace(
    hidden_size=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=24, num_hidden_layers=2
)
SHAPES = {"q_proj": (16, 16), "k_proj": (16, 8), "v_proj": (16, 8), "o_proj": (16, 16),
          "gate_proj": (16, 24), "up_proj": (16, 24), "down_proj": (24, 16)}


def _write_adapter(path, rank=4, modules=("q_proj", "v_proj"), extra_keys=None, **config):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": list(modules), **config})
    )
    tensors = {}
    for layer in range(2):
        for module in modules:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            fan_in, fan_out = SHAPES[module]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank)
    tensors.update(extra_keys or {})
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return LoRARequest(path.name, 1, str(path))


def test_adapter_scaling_and_rslora(tmp_path):
    plain = load_adapter(_write_adapter(tmp_path / "plain", rank=4), HF, 16)
    assert plain.scaling == 2.0 and plain.rank == 4
    assert set(plain.modules) == {f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "v_proj")}
    rs = load_adapter(_write_adapter(tmp_path / "rs", rank=4, use_rslora=True), HF, 16)
    assert rs.scaling == 4.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(use_dora=True), "use_dora=true: DoRA"),
        (dict(rank=32), "r=32 is above max_lora_rank=16"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(bias="all"), "bias='all'"),
        (dict(peft_type="IA3"), "peft_type is 'IA3'"),
        (dict(extra_keys={"base_model.model.model.layers.0.mlp.fc1.lora_A.weight": torch.zeros(4, 16)}),
         "no module 'model.layers.0.mlp.fc1'"),
        (dict(extra_keys={"base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight": torch.zeros(4, 16)}),
         "2 layers"),
        (dict(extra_keys={"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 16)}),
         "embeddings or the LM head"),
        (dict(extra_keys={"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 16)}),
         "embeddings or the LM head"),
        (dict(extra_keys={"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 15)}),
         "needs (4, 16)"),
    ],
)
def test_unsupported_adapters_are_refused_by_name(tmp_path, kwargs, message):
    request = _write_adapter(tmp_path / "bad", **kwargs)
    with pytest.raises(ValueError, match="LoRA adapter 'bad'") as error:
        load_adapter(request, HF, 16)
    assert message in str(error.value)


def test_missing_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_adapter(LoRARequest("gone", 1, str(tmp_path / "gone")), HF, 16)
    request = _write_adapter(tmp_path / "half")
    (tmp_path / "half" / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        load_adapter(request, HF, 16)


def test_lora_request_checks_its_fields():
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/x")


def test_config_refuses_lora_settings_it_cannot_honour(tmp_path):
    with pytest.raises(ValueError, match="max_loras=2 needs enable_lora=True"):
        EngineConfig(max_loras=2)
    with pytest.raises(ValueError, match="max_cpu_loras=1 must be at least max_loras=2"):
        EngineConfig(enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="enable_lora with tensor parallelism"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2, distributed_executor_backend="mp")
    with pytest.raises(ValueError, match="speculative decoding by 'draft_model'"):
        EngineConfig(
            enable_lora=True,
            speculative_config={"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2},
        )
    assert EngineConfig(enable_lora=True, max_loras=3).max_cpu_loras == 3


def _lora_req(i, lora_id, n=8):
    lora = LoRARequest(f"a{lora_id}", lora_id, "/x") if lora_id else None
    return Request(
        str(i), list(range(i * 100, i * 100 + n)), SamplingParams(max_tokens=4), None, 4,
        arrival_time=float(i), lora_request=lora, block_hasher=make_block_hasher(4),
    )


def test_scheduler_admits_at_most_max_loras_adapters_and_none_starves():
    kv = KVCacheManager(256, 4, 128, enable_caching=True)
    s = Scheduler(SchedulerConfig(16, 512, 128, max_loras=2), kv)
    # adapters 1, 2, then 3 (one too many), then more of 1 and base requests
    for i, lora_id in enumerate([1, 2, 3, 1, 0, 2, 0]):
        s.add_request(_lora_req(i, lora_id))
    out = s.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["0", "1", "4", "6"]
    assert s.lora_adapters() == ({"a1", "a2"}, {"a1", "a2", "a3"})
    assert [r.request_id for r in s.waiting] == ["2", "3", "5"]  # order kept
    admitted_at = {}
    for step in range(1, 20):
        sampled = {rid: [7] for rid in out.num_scheduled_tokens}
        s.update_from_output(out, sampled)
        out = s.schedule()
        running = {r.lora_int_id for r in s.running} - {0}
        assert len(running) <= 2
        for new in out.scheduled_new_reqs:
            admitted_at[new.req_id] = step
        if not s.has_unfinished_requests():
            break
    assert not s.has_unfinished_requests()
    # the waiting adapter 3 goes in before the later requests of the adapters that ran
    assert admitted_at["2"] <= admitted_at["3"] and admitted_at["2"] <= admitted_at["5"]


def test_prefix_cache_keys_include_the_adapter():
    hasher = make_block_hasher(4)

    def hashes(lora_id, name="a"):
        lora = LoRARequest(name, lora_id, "/x") if lora_id else None
        req = Request("r", list(range(8)), SamplingParams(), None, 4, lora_request=lora, block_hasher=hasher)
        return req.block_hashes

    assert hashes(1) == hashes(1)
    assert len({hashes(0)[0], hashes(1)[0], hashes(2)[0], hashes(1, "b")[0]}) == 4
