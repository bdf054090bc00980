"""Progress and start-up logging: the engine's INFO summary, the bench commands' progress bars
on stderr (their reports stay alone on stdout)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import make_tiny_checkpoint, save_byte_tokenizer

from tokenmill.benchmarks import serve as bench_serve
from tokenmill.cli import main
from tokenmill.entrypoints.llm import LLM
from tokenmill.interfaces.attention import AttentionConfig
from tokenmill.platforms.cpu import CpuPlatform

ENGINE_FLAGS = ["--num-kv-blocks", "32", "--block-size", "8", "--max-model-len", "128"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m")
    save_byte_tokenizer(path)
    return path


def summary(caplog: pytest.LogCaptureFixture) -> str:
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "tokenmill.engine.engine_core" and r.getMessage().startswith("model ")
    ]
    assert len(lines) == 1, caplog.text
    return lines[0]


def log_from_subprocess(**env: str) -> subprocess.CompletedProcess:
    code = (
        "import logging, tokenmill; "
        "logging.getLogger('tokenmill.x').info('hello'); logging.getLogger('tokenmill.x').warning('hey')"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**{k: v for k, v in os.environ.items() if not k.endswith("LOGGING_LEVEL")}, **env},
    )


@pytest.mark.parametrize(
    ("env", "shown"),
    [
        ({}, ["INFO", "WARNING"]),
        ({"TOKENMILL_LOGGING_LEVEL": "warning"}, ["WARNING"]),
        ({"TOKENMILL_CONFIGURE_LOGGING": "0"}, ["hey"]),
    ],
)
def test_tokenmill_logger_writes_to_stderr_at_info(env, shown):
    proc = log_from_subprocess(**env)
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    lines = proc.stderr.splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == shown, lines
    if shown != ["hey"]:
        assert re.fullmatch(r"WARNING \d\d-\d\d \d\d:\d\d:\d\d \[<string>:1\] hey", lines[-1])


def test_unknown_logging_level_is_an_error():
    proc = log_from_subprocess(TOKENMILL_LOGGING_LEVEL="LOUD")
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        "ValueError: TOKENMILL_LOGGING_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL, "
        "got 'LOUD'"
    )


def test_engine_logs_a_start_up_summary(tiny, caplog, monkeypatch):
    monkeypatch.delenv("TOKENMILL_ATTENTION_BACKEND", raising=False)
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        LLM(model=tiny, num_kv_blocks=32, block_size=8, max_model_len=128)
    assert summary(caplog) == (
        f"model tokenmill.models.llama.LlamaForCausalLM from {tiny}, dtype float32, "
        "max_model_len 128; platform cpu; attention backend cpu_sdpa (automatic: the first to "
        "serve the model among platform cpu's candidates cpu_sdpa, torch); uni executor, "
        "1 rank(s); KV cache 32 blocks of 8 tokens (0.1 MiB per rank)"
    )


def test_summary_names_who_chose_the_backend(tiny, caplog, monkeypatch):
    monkeypatch.setenv("TOKENMILL_ATTENTION_BACKEND", "cpu_sdpa")
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        LLM(model=tiny, num_kv_blocks=32, block_size=8, attention_backend="torch")
    assert "; attention backend torch (set by attention_backend);" in summary(caplog)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        LLM(model=tiny, num_kv_blocks=32, block_size=8)
    assert "; attention backend cpu_sdpa (set by TOKENMILL_ATTENTION_BACKEND);" in summary(caplog)


def test_automatic_choice_names_the_candidates_passed_over(monkeypatch):
    from tokenmill.selector import choose_attention_backend

    class TwoCandidates(CpuPlatform):
        name = "two"

        @classmethod
        def get_attn_backend_candidates(cls, config: AttentionConfig) -> list[str]:
            return ["flash_attn", "torch"]

    monkeypatch.delenv("TOKENMILL_ATTENTION_BACKEND", raising=False)
    config = AttentionConfig(head_size=64, dtype=torch.float32)
    backend, why = choose_attention_backend(TwoCandidates, config)
    assert backend.get_name() == "torch"
    assert why.startswith(
        "automatic: the first to serve the model among platform two's candidates "
        "flash_attn, torch; passed over flash_attn: "
    ), why


def test_bench_throughput_shows_progress_on_stderr(tiny, capsys, monkeypatch):
    monkeypatch.setattr("tokenmill.entrypoints.llm.SPEED_REFRESH_S", 0.0)
    argv = ["bench", "throughput", "--model", tiny, "--num-prompts", "3", "--input-len", "8"]
    assert main([*argv, "--output-len", "4", *ENGINE_FLAGS]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Throughput: ") and len(out.splitlines()) == 3, out
    final = err.split("\r")[-1]
    assert re.match(r"Processed prompts: 100%.* 3/3 .*est\. speed output: \d+\.\d toks/s", final)


def test_bench_latency_shows_progress_on_stderr(tiny, capsys):
    argv = ["bench", "latency", "--model", tiny, "--batch-size", "2", "--input-len", "8"]
    assert main([*argv, "--output-len", "4", "--num-iters", "2", *ENGINE_FLAGS]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Avg latency: "), out
    assert "Warmup iterations: 100%" in err and "Profiling iterations: 100%" in err
    assert "| 2/2 [" in err.split("Profiling iterations")[-1]


def test_bench_serve_shows_progress_on_stderr(capsys, monkeypatch):
    async def send(client, args, model, request):
        return bench_serve.RequestResult(success=True, output_tokens=request.output_len)

    monkeypatch.setattr(bench_serve, "_send", send)
    monkeypatch.setattr(
        bench_serve,
        "_dataset",
        lambda args: [bench_serve.BenchRequest([1, 2], 3) for _ in range(args.num_prompts)],
    )
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--num-prompts", "5"])
    report = asyncio.run(bench_serve.benchmark(args))
    assert report["completed"] == 5
    out, err = capsys.readouterr()
    assert "Requests: 100%" in err and "| 5/5 [" in err
    assert "Requests" not in out and "Serving Benchmark Result" in out
