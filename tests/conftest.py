"""Shared fixtures (the default model, its HF twin, tiny random checkpoints), Triton's
interpreter when there is no GPU, and `--fail-on-skip`."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tokenmill.logprobs import Logprob

torch.set_num_threads(2)

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run under the interpreter, which ``triton.jit`` chooses
    # when a function is defined; torch._dynamo imports triton while other test modules load,
    # so the variable is set here, before any of them.
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_addoption(parser):
    parser.addoption(
        "--fail-on-skip",
        action="store_true",
        help="fail every skipped test that is not marked gpu (make test and CI use this)",
    )


@pytest.fixture(autouse=True)
def _tokenmill_logs_reach_caplog(monkeypatch):
    """The ``tokenmill`` logger does not propagate (as vLLM's); in tests it does, so that
    ``caplog`` sees its records."""
    monkeypatch.setattr(logging.getLogger("tokenmill"), "propagate", True)


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))


def _fail_skip(report, node) -> None:
    """Under ``--fail-on-skip``, turn a skip of a test not marked ``gpu`` into a failure."""
    if (
        report.skipped
        and not hasattr(report, "wasxfail")
        and node.config.getoption("--fail-on-skip")
        and node.get_closest_marker("gpu") is None
    ):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (
            "skipped under --fail-on-skip (only gpu tests may skip): "
            + str(reason).removeprefix("Skipped: ")
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _fail_skip(report, item)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    _fail_skip(report, collector)
    return report


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from tokenmill.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def default_llm(default_model_dir):
    """One in-process engine on the default model with 256 MiB of KV cache, shared by every
    module that needs no other setting; each test leaves it idle."""
    from tokenmill import LLM

    return LLM(kv_cache_memory_bytes=256 << 20)


@pytest.fixture(scope="session")
def default_server():
    """One ``tokenmill serve`` of the default model with the default flags plus
    ``--enable-prompt-tokens-details`` (so usage shows cached tokens) and the Hermes tool-call
    parser (``--enable-auto-tool-choice``, for tests/server/test_tool_calls.py), shared by every
    module that needs no other flags (a server takes tens of seconds to start on 2 cores); a
    test that changes what a later test sees leaves it idle (``RemoteServer.wait_idle``)."""
    from server.test_server import RemoteServer

    srv = RemoteServer(
        "--enable-prompt-tokens-details", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"
    )
    yield srv
    srv.stop()


EXAMPLE_SRC = Path(__file__).resolve().parents[1] / "plugins_example"


@pytest.fixture(scope="session")
def example_plugin_site(tmp_path_factory) -> Path:
    """``plugins_example`` pip-installed into a private directory (not on ``sys.path``)."""
    root = tmp_path_factory.mktemp("example_plugin")
    src, target = root / "src", root / "site"
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    shutil.copytree(EXAMPLE_SRC, src, ignore=ignore)
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(src)],
        capture_output=True,
        text=True,
    )
    assert pip.returncode == 0, pip.stderr
    return target


@pytest.fixture(scope="session")
def hf_default_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def make_tiny_checkpoint(path, arch: str = "llama", **overrides) -> str:
    """Save a tiny random HF model (no tokenizer) under ``path`` and return the dir."""
    import transformers

    from tokenmill.testing.checkpoints import TINY_CONFIG

    common = dict(TINY_CONFIG, max_position_embeddings=1024)
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**common)).to(torch.float32).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF greedy continuation (never stopping at EOS) and the logits at each generated position."""
    ids = torch.tensor([prompt_ids])
    tokens, scores, past = [], [], None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            scores.append(logits)
            ids = torch.tensor([[token]])
    return tokens, scores


def assert_greedy_close(ours: list[int], our_logprobs: list[dict[int, Logprob]], ref: list[int], ref_scores) -> None:
    """Equal tokens, or at the first divergence each side's token is in the other's top-5
    (vLLM's criterion for comparing against HF)."""
    for k, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            continue
        ref_top5 = torch.topk(ref_scores[k], 5).indices.tolist()
        our_top5 = sorted(our_logprobs[k], key=lambda t: our_logprobs[k][t].logprob, reverse=True)[:5]
        assert a in ref_top5, f"position {k}: our token {a} not in HF top-5 {ref_top5}"
        assert b in our_top5, f"position {k}: HF token {b} not in our top-5 {our_top5}"
        return
    assert len(ours) == len(ref)


def assert_same_completions(got, want, tol: float = 1e-4) -> None:
    """Two lists of ``RequestOutput`` hold the same completions: equal token ids, text, finish
    reasons and top-logprob tokens with their ranks, logprobs within ``tol``. Two engines (one
    with a connector, one without) may differ in a float's last bits; logprobs rounded to a few
    places then fail on either side of a rounding boundary."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for go, wo in zip(g.outputs, w.outputs, strict=True):
            assert (go.token_ids, go.text, go.finish_reason) == (wo.token_ids, wo.text, wo.finish_reason)
            assert (go.logprobs is None) == (wo.logprobs is None)
            for gs, ws in zip(go.logprobs or [], wo.logprobs or [], strict=True):
                assert {t: lp.rank for t, lp in gs.items()} == {t: lp.rank for t, lp in ws.items()}
                for t, lp in gs.items():
                    assert lp.logprob == pytest.approx(ws[t].logprob, abs=tol)


def save_byte_tokenizer(path) -> None:
    """Save a byte-level tokenizer under ``path`` whose 256 ids are the 256 bytes (no merges),
    matching ``make_tiny_checkpoint``'s vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(path))


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.logged: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.logged.append((record.name, record.levelno, record.getMessage()))


@pytest.fixture
def tokenmill_log() -> Iterator[list[tuple[str, int, str]]]:
    """(logger, level, message) of each record of the ``tokenmill`` loggers from DEBUG up,
    whatever handlers and propagation they have."""
    logger = logging.getLogger("tokenmill")
    handler, previous = _Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.logged
    logger.setLevel(previous)
    logger.removeHandler(handler)


def help_without_torch(env: dict[str, str]) -> subprocess.CompletedProcess:
    """``tokenmill --help`` in a fresh interpreter with ``env``; fails unless it exits 0 without
    importing torch."""
    code = (
        "import sys\n"
        "from tokenmill import cli\n"
        "try:\n"
        "    cli.main(['--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "assert 'torch' not in sys.modules, 'tokenmill --help imported torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return done
