"""Sliding-window attention: tiny random Mistral and Qwen2 models whose prompts and generations
run well past the window match HF transformers through the whole engine, on the reference and
the CPU backends (C decode kernel and torch fallback); the backends match a dense windowed
reference on paged batches; backends without sliding windows refuse them with a reason."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import hf_greedy, make_tiny_checkpoint
from tokenmill.testing.paged import random_batch, run_backend
from tokenmill import LLM, SamplingParams
from tokenmill.attention_backends.cpu_sdpa import CpuSdpaBackend
from tokenmill.attention_backends.torch_ref import TorchRefBackend
from tokenmill.interfaces.attention import AttentionBackend, AttentionConfig
from tokenmill.layers.attention import Attention
from tokenmill.layers.build_context import BuildContext, model_build_context
from tokenmill.model_loader import load_hf_config, load_model
from tokenmill.ops import cpu as cpu_ops
from tokenmill.platforms.cpu import CpuPlatform
from tokenmill.platforms.cuda import CudaPlatform
from tokenmill.selector import backend_reasons, select_attention_backend

WINDOW = 8
# (architecture, checkpoint overrides, HF overrides that turn the window off)
MODELS = {
    "mistral": ("mistral", {"sliding_window": WINDOW}, {"sliding_window": None}),
    # Qwen2 slides only in layers >= max_window_layers: here layer 1 of 2.
    "qwen2": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
        {"use_sliding_window": False, "layer_types": ["full_attention"] * 2},
    ),
}
PROMPT_LENS = (5, 23, 41)
MAX_TOKENS = 24


@pytest.fixture(scope="module", params=list(MODELS))
def windowed_model(request, tmp_path_factory) -> tuple[str, str, list[list[int]], list]:
    """A windowed checkpoint, its case, its prompts and HF's greedy tokens and logits."""
    arch, overrides, _ = MODELS[request.param]
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENS]
    return path, request.param, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def test_hf_window_changes_the_outputs(windowed_model):
    """Guards the comparisons below: without the window HF predicts other logits."""
    path, case, prompts, refs = windowed_model
    no_window = MODELS[case][2]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **no_window).eval()
    _, full_scores = hf_greedy(hf, prompts[-1], MAX_TOKENS)
    windowed_scores = refs[-1][1]
    assert (full_scores[0] - windowed_scores[0]).abs().max() > 1e-2


@pytest.fixture(params=["torch", "cpu_sdpa-c-kernel", "cpu_sdpa-torch-fallback"])
def backend_name(request, monkeypatch) -> str:
    if request.param == "cpu_sdpa-c-kernel":
        assert cpu_ops.load() is not None, "the C kernels should build on this machine"
    elif request.param == "cpu_sdpa-torch-fallback":
        monkeypatch.setattr(cpu_ops, "load", lambda: None)
    return request.param.split("-")[0]


def test_engine_matches_hf_past_the_window(windowed_model, backend_name):
    """Block size 4 and 16-token steps: prefill chunks start past the window, mixed with
    decodes; every generated token's top logprobs equal HF's."""
    path, _, prompts, refs = windowed_model
    llm = LLM(
        model=path,
        attention_backend=backend_name,
        block_size=4,
        num_kv_blocks=128,
        max_num_batched_tokens=16,
        max_model_len=128,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, (ref_tokens, ref_scores) in zip(outputs, refs):
        assert list(out.outputs[0].token_ids) == ref_tokens
        for logprobs, scores in zip(out.outputs[0].logprobs, ref_scores):
            ref_logprobs = torch.log_softmax(scores, -1)
            for token, logprob in logprobs.items():
                assert logprob.logprob == pytest.approx(float(ref_logprobs[token]), abs=1e-3)


def test_layers_slide_as_their_config_says(windowed_model):
    """Mistral slides in every layer, Qwen2 from layer ``max_window_layers`` on."""
    path, case, _, _ = windowed_model
    model = load_model(path, load_hf_config(path), BuildContext(TorchRefBackend), "cpu")
    windows = [m.sliding_window for m in model.modules() if isinstance(m, Attention)]
    assert windows == ([WINDOW, WINDOW] if case == "mistral" else [None, WINDOW])


def dense_windowed_attention(batch, sliding_window: int | None) -> torch.Tensor:
    """Each query token against the keys of its own request at positions ``p - window < j <= p``,
    one token at a time in float64 over the cache with the step's K/V written in."""
    cache = batch.kv_cache.double().flatten(1, 2).clone()  # [2, slots, kv_heads, head_size]
    cache[0, batch.common.slot_mapping] = batch.key.double()
    cache[1, batch.common.slot_mapping] = batch.value.double()
    num_heads, head_size = batch.query.shape[1:]
    group = num_heads // batch.key.shape[1]
    qsl, seq_lens = batch.common.query_start_loc_cpu.tolist(), batch.common.seq_lens_cpu.tolist()
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    for r, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len)
        blocks = batch.common.block_table[r, positions // batch.block_size].long()
        slots = blocks * batch.block_size + positions % batch.block_size
        for row in range(qsl[r], qsl[r + 1]):
            p = seq_len - (qsl[r + 1] - row)
            first = 0 if sliding_window is None else max(0, p - sliding_window + 1)
            k = cache[0, slots[first : p + 1]].repeat_interleave(group, 1)  # [n, heads, d]
            v = cache[1, slots[first : p + 1]].repeat_interleave(group, 1)
            q = batch.query[row].double()
            weights = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * head_size**-0.5, -1)
            out[row] = torch.einsum("hn,nhd->hd", weights, v)
    return out


# (query_lens, context_lens): decodes short of, at, just past and far past the window; a chunk
# starting mid-context past the window; a fresh prefill longer than the window; a chunk whose
# window starts inside its first cached block.
WINDOWED_SHAPES = [
    ([1, 1, 1, 1, 7, 12], [3, 7, 8, 30, 29, 0]),
    ([5, 1, 16], [10, 41, 2]),
]


@pytest.mark.parametrize("shape", WINDOWED_SHAPES)
@pytest.mark.parametrize("sliding_window", [1, WINDOW, 100, None])
@pytest.mark.parametrize("layout", [(4, 2, 64, 4), (6, 1, 32, 5)])
def test_backend_matches_dense_windowed_reference(backend_name, shape, sliding_window, layout):
    backend = {"torch": TorchRefBackend, "cpu_sdpa": CpuSdpaBackend}[backend_name]
    num_heads, num_kv_heads, head_size, block_size = layout
    batch = random_batch(*shape, num_heads, num_kv_heads, head_size, block_size, seed=3)
    out, _ = run_backend(backend, batch, sliding_window=sliding_window)
    expected = dense_windowed_attention(batch, sliding_window)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


def test_c_kernel_windows_around_block_boundaries():
    """Windows of every size around the block boundaries, through the C kernel alone."""
    assert cpu_ops.load() is not None
    context_lens = list(range(0, 40, 3))
    batch = random_batch([1] * len(context_lens), context_lens, 8, 2, 32, 4, seed=7)
    for window in (1, 2, 3, 4, 5, 7, 8, 9, 17):
        expected = dense_windowed_attention(batch, window)
        out, _ = run_backend(CpuSdpaBackend, batch, sliding_window=window)
        torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


def _example_backend(monkeypatch) -> type[AttentionBackend]:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "plugins_example"))
    from tokenmill_example_plugin.attention import HeadMajorBackend

    return HeadMajorBackend


WINDOWED_CUDA = AttentionConfig(
    head_size=64, dtype=torch.float16, block_size=256, device_type="cuda", sliding_window=WINDOW
)


@pytest.mark.parametrize("name", ["triton", "flash_attn", "flashinfer"])
def test_backends_without_windows_refuse_them(name):
    reasons = backend_reasons(name, WINDOWED_CUDA)
    assert any("sliding-window attention" in r for r in reasons), reasons
    with pytest.raises(ValueError, match="sliding-window attention"):
        select_attention_backend(CpuPlatform, WINDOWED_CUDA, name)


def test_example_plugin_backend_refuses_windows(monkeypatch):
    backend = _example_backend(monkeypatch)
    config = AttentionConfig(head_size=64, dtype=torch.float32, sliding_window=WINDOW)
    assert backend.validate_configuration(config) == ["sliding-window attention is not implemented"]
    assert backend.validate_configuration(AttentionConfig(head_size=64, dtype=torch.float32)) == []


class GpuKernelsOnly(CudaPlatform):
    attn_backend_priority = ("flash_attn", "flashinfer", "triton")


def test_selector_lists_the_reasons_when_nothing_fits():
    with pytest.raises(ValueError, match="no attention backend") as err:
        select_attention_backend(GpuKernelsOnly, WINDOWED_CUDA)
    for name in GpuKernelsOnly.attn_backend_priority:
        assert f"{name}: " in str(err.value)
    assert "sliding-window attention (window 8) is not supported" in str(err.value)


def test_platforms_pick_a_backend_with_windows():
    config = AttentionConfig(head_size=64, dtype=torch.float32, sliding_window=WINDOW)
    assert select_attention_backend(CpuPlatform, config) is CpuSdpaBackend
    assert select_attention_backend(CudaPlatform, WINDOWED_CUDA) is TorchRefBackend


def test_engine_refuses_a_backend_without_windows(windowed_model):
    with pytest.raises(ValueError, match="triton.*sliding-window attention"):
        LLM(model=windowed_model[0], attention_backend="triton")


@pytest.mark.parametrize("backend", ["example", "triton"])
def test_attention_layer_never_drops_its_window(backend, monkeypatch):
    """A window reaching a backend that cannot honour it is an error, not full attention."""
    if backend == "example":
        backend_cls = _example_backend(monkeypatch)
    else:
        from tokenmill.attention_backends.triton_attn import TritonAttentionBackend as backend_cls
    with model_build_context(BuildContext(backend_cls)):
        Attention(4, 16, 0.25, 2, prefix="layers.0.attn")
        with pytest.raises(ValueError, match="layers.1.attn: .* does not support sliding-window"):
            Attention(4, 16, 0.25, 2, prefix="layers.1.attn", sliding_window=WINDOW)
