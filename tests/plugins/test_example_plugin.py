"""The out-of-tree example plugin (``plugins_example/``), pip-installed into a temporary directory:
its platform (with its own RMSNorm op), head-major attention backend, GPT-2 model and
``example-hello`` command register through the entry point, generate HF's greedy tokens, and
leave the defaults alone."""

from __future__ import annotations

import importlib
import logging
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from conftest import assert_greedy_close, help_without_torch, hf_greedy, make_tiny_checkpoint
from tokenmill import LLM, SamplingParams, cli, plugins
from tokenmill.attention_backends.torch_ref import TorchRefBackend
from tokenmill.interfaces import AttentionConfig, CommonAttentionMetadata, FullAttentionSpec
from tokenmill.layers.build_context import BuildContext, model_build_context
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.selector import select_attention_backend, select_platform

DIST = "tokenmill-example-plugin"
PARTS = {
    "platforms": "example",
    "attention_backends": "example-hnd",
    "models": "GPT2LMHeadModel",
    "commands": "example-hello",
    "proposers": "corpus-lookup",
}
ENV_VARS = (
    "TOKENMILL_PLUGINS",
    "TOKENMILL_PLATFORM",
    "TOKENMILL_ATTENTION_BACKEND",
    "TOKENMILL_EXAMPLE_PLATFORM",
)


def _forget_example_modules() -> None:
    for name in [m for m in sys.modules if m.startswith("tokenmill_example_plugin")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def installed(example_plugin_site) -> Iterator[Path]:
    """The installed example put on ``sys.path``; undone after."""
    target = example_plugin_site
    with pytest.MonkeyPatch.context() as mp:
        for var in ENV_VARS:
            mp.delenv(var, raising=False)
        mp.syspath_prepend(str(target))
        plugins.reload_plugins()
        yield target
    _forget_example_modules()
    importlib.invalidate_caches()
    plugins.reload_plugins()


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory) -> tuple[GPT2LMHeadModel, Path]:
    """A random tiny GPT-2 saved by transformers; biases and LayerNorms perturbed so they count."""
    config = GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=256,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(str(path))
    return model, path


@pytest.fixture(scope="module")
def legacy_gpt2(hf_gpt2, tmp_path_factory) -> Path:
    """The same weights named like OpenAI's original checkpoint: no ``transformer.`` prefix, no
    ``lm_head``, and the causal-mask buffers ``h.N.attn.bias``."""
    _, path = hf_gpt2
    legacy = tmp_path_factory.mktemp("gpt2_legacy")
    shutil.copy(path / "config.json", legacy / "config.json")
    tensors = {
        name.removeprefix("transformer."): t
        for name, t in load_file(path / "model.safetensors").items()
        if not name.startswith("lm_head.")
    }
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(256, 256)).view(1, 1, 256, 256)
    save_file(tensors, legacy / "model.safetensors", metadata={"format": "pt"})
    return legacy


def test_parts_registered_from_distribution(installed):
    for kind, name in PARTS.items():
        reg = plugins.get_registry(kind).get(name)
        assert (reg.plugin, reg.distribution) == ("example", DIST)


def _env(installed: Path) -> dict[str, str]:
    """The environment of a subprocess that sees the installed example."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(installed), env.get("PYTHONPATH", "")])
    return env


def test_cli_lists_parts(installed):
    out = subprocess.run(
        [sys.executable, "-m", "tokenmill", "plugins"],
        env=_env(installed),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    for name in PARTS.values():
        assert f"from {DIST}" in lines[name]
    assert "[selected]" not in lines["example"]


def test_plugin_command_in_help_without_torch_and_runs(installed, capsys):
    done = help_without_torch(_env(installed))
    commands = {line.split()[0]: line for line in done.stdout.splitlines() if line[:4] == " " * 4}
    assert "greet from the example plugin" in commands["example-hello"]
    assert {"generate", "chat", "plugins", "bench", "serve"} <= set(commands)
    assert "broken plugins" not in done.stdout
    assert cli.main(["example-hello", "--name", "tests"]) == 0
    assert capsys.readouterr().out == "Hello, tests, from the tokenmill example plugin!\n"


def test_default_platform_unchanged(installed):
    default = select_platform()
    assert plugins.get_registry("platforms").get(default.name).distribution == "tokenmill"


@pytest.mark.parametrize(
    "env", [{"TOKENMILL_PLATFORM": "example"}, {"TOKENMILL_EXAMPLE_PLATFORM": "1"}]
)
def test_platform_chosen_when_asked(installed, monkeypatch, env):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    platform = select_platform()
    assert platform.name == "example"
    backend = select_attention_backend(platform, AttentionConfig(head_size=16, dtype=torch.float32))
    assert backend.get_name() == "example-hnd"


def test_platform_dtype_policy(installed, hf_gpt2):
    with pytest.raises(ValueError, match="bfloat16 is not supported on platform 'example'"):
        LLM(model=str(hf_gpt2[1]), platform="example", dtype="bfloat16")


def test_engine_logs_parts_from_the_plugin(installed, hf_gpt2, tokenmill_log):
    model = str(hf_gpt2[1])
    LLM(model=model, platform="example", attention_backend="example-hnd", num_kv_blocks=16)
    source = f"from plugin 'example' (distribution '{DIST}')"
    parts = [
        "platform 'example': tokenmill_example_plugin.platform:ExamplePlatform",
        "model 'GPT2LMHeadModel': tokenmill_example_plugin.gpt2:GPT2LMHeadModel",
        "attention backend 'example-hnd': tokenmill_example_plugin.attention:HeadMajorBackend",
    ]
    logged = [(level, msg) for name, level, msg in tokenmill_log if name == "tokenmill.plugins"]
    assert logged == [(logging.INFO, f"using {part} {source}") for part in parts]


def i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _step(reqs: list[tuple[list[int], int, int]], block_size: int) -> CommonAttentionMetadata:
    """Metadata for one step; ``reqs`` holds (block row, tokens already cached, new tokens)."""
    qsl, slots, seq_lens, computed = [0], [], [], []
    for blocks, done, new in reqs:
        qsl.append(qsl[-1] + new)
        positions = range(done, done + new)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in positions]
        seq_lens.append(done + new)
        computed.append(done)
    width = max(len(b) for b, _, _ in reqs)
    table = torch.tensor([b + [0] * (width - len(b)) for b, _, _ in reqs], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=i32(qsl), query_start_loc_cpu=i32(qsl), seq_lens=i32(seq_lens),
        seq_lens_cpu=i32(seq_lens), num_computed_tokens_cpu=i32(computed), block_table=table,
        slot_mapping=torch.tensor(slots), num_reqs=len(reqs), num_actual_tokens=qsl[-1],
        max_query_len=max(n for _, _, n in reqs), max_seq_len=max(seq_lens),
    )


def test_head_major_backend_matches_reference(installed):
    """Same steps through both backends: equal outputs, and the caches hold the same K/V with
    the token and head axes of each block swapped."""
    backend = plugins.get_registry("attention_backends").load("example-hnd")
    heads, kv_heads, head_size, block_size, num_blocks = 4, 2, 8, 4, 10
    spec = FullAttentionSpec(block_size, torch.float32, kv_heads, head_size)
    caches, impls, builders = {}, {}, {}
    for b in (backend, TorchRefBackend):
        caches[b] = torch.zeros(b.get_kv_cache_shape(num_blocks, block_size, kv_heads, head_size))
        impls[b] = b.get_impl_cls()(heads, head_size, head_size**-0.5, kv_heads)
        builders[b] = b.get_metadata_builder_cls()(spec, torch.device("cpu"))
    assert caches[backend].shape == (2, num_blocks, kv_heads, block_size, head_size)

    a_blocks, b_blocks = [7, 2, 5], [9, 0]
    steps = [  # prefill of A and B; then a chunk of A with a decode of B; then two decodes
        [(a_blocks, 0, 6), (b_blocks, 0, 3)],
        [(a_blocks, 6, 4), (b_blocks, 3, 1)],
        [(a_blocks, 10, 1), (b_blocks, 4, 1)],
    ]
    torch.manual_seed(0)
    for reqs in steps:
        common = _step(reqs, block_size)
        n = common.num_actual_tokens
        q = torch.randn(n, heads, head_size)
        k, v = torch.randn(2, n, kv_heads, head_size)
        out = {
            b: impls[b].forward(q, k, v, caches[b], builders[b].build(common))
            for b in (backend, TorchRefBackend)
        }
        torch.testing.assert_close(out[backend], out[TorchRefBackend])
    torch.testing.assert_close(caches[backend].transpose(2, 3), caches[TorchRefBackend])


@pytest.mark.parametrize(
    "checkpoint, engine_args",
    [
        ("transformers", {}),
        ("transformers", {"max_num_batched_tokens": 16, "block_size": 8}),
        ("legacy", {}),
    ],
    ids=["default", "chunked-prefill", "legacy-names"],
)
def test_gpt2_greedy_matches_hf(installed, hf_gpt2, legacy_gpt2, checkpoint, engine_args):
    hf, path = hf_gpt2
    model_dir = path if checkpoint == "transformers" else legacy_gpt2
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3, 20, 41)]
    llm = LLM(
        model=str(model_dir), platform="example", attention_backend="example-hnd",
        num_kv_blocks=64, **engine_args,
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    refs = [hf_greedy(hf, p, 12) for p in prompts]
    for _ in range(2):  # the second pass reads prompts back from the prefix cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for out, (ref, scores) in zip(outputs, refs):
            assert_greedy_close(out.outputs[0].token_ids, out.outputs[0].logprobs, ref, scores)
    stats = llm.get_stats()
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_platform_rms_norm_op_equals_forward_native(installed):
    platform = plugins.get_registry("platforms").load("example")
    ops = importlib.import_module("tokenmill_example_plugin.ops")
    with model_build_context(BuildContext(TorchRefBackend, ops=platform.get_ops())):
        norm = RMSNorm(32, eps=1e-5)
    norm.weight.data.normal_()
    x, residual = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    ops.CALLS.clear()
    torch.testing.assert_close(norm(x), norm.forward_native(x))
    for got, want in zip(norm(x, residual), norm.forward_native(x, residual)):
        torch.testing.assert_close(got, want)
    assert ops.CALLS["rms_norm"] == 2


def test_platform_swaps_in_its_rms_norm(installed, tmp_path):
    """A 2-layer Llama on the example platform: its 5 RMSNorms run the platform's op in each of
    the 8 steps, and the greedy tokens are HF's."""
    path = make_tiny_checkpoint(tmp_path)
    ops = importlib.import_module("tokenmill_example_plugin.ops")
    ops.CALLS.clear()
    llm = LLM(model=path, platform="example", num_kv_blocks=64)
    prompt = [1, 17, 42, 99, 5]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert ops.CALLS["rms_norm"] >= 5 * 8, ops.CALLS
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert_greedy_close(out.token_ids, out.logprobs, *hf_greedy(hf, prompt, 8))


def test_corpus_lookup_proposer_used_by_name(installed, tmp_path):
    """The plugin's proposer, named in ``speculative_config``, drafts from the corpus; greedy
    outputs are the non-speculative ones and the corpus continuation is accepted."""
    target = make_tiny_checkpoint(tmp_path / "tiny")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    reference = LLM(model=target, num_kv_blocks=32).generate([prompt], params, use_tqdm=False)[0]
    corpus = [prompt["prompt_token_ids"] + reference.outputs[0].token_ids]
    spec = {"method": "corpus-lookup", "num_speculative_tokens": 4, "corpus_token_ids": corpus}
    llm = LLM(model=target, num_kv_blocks=32, speculative_config=spec)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids
    stats = llm.get_stats()
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"] > 0
    with pytest.raises(ValueError, match=r"unknown speculative_config key\(s\) for 'corpus-lookup': colour"):
        LLM(model=target, num_kv_blocks=32, speculative_config={**spec, "colour": 1})


def test_uninstall_removes_parts(installed):
    dist_info = next(installed.glob("tokenmill_example_plugin-*.dist-info"))
    package = installed / "tokenmill_example_plugin"
    away = installed.parent / "uninstalled"
    away.mkdir(exist_ok=True)
    try:
        for path in (dist_info, package):
            path.rename(away / path.name)
        importlib.invalidate_caches()
        plugins.reload_plugins()
        for kind, name in PARTS.items():
            assert name not in plugins.get_registry(kind)
        assert "cpu" in plugins.get_registry("platforms")
    finally:
        for path in (dist_info, package):
            (away / path.name).rename(path)
        importlib.invalidate_caches()
        plugins.reload_plugins()
