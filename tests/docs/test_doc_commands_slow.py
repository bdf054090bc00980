"""The docs' heavier shell blocks, run as written (marked ``slow``): several worker processes of
the default model, Ray clusters, the disaggregated trio, the LoRA server, the benchmarks at their
documented sizes, the conformance kit's commands and the browser tests.

Each block runs command by command, as a shell would, with only what a test must change: every
port the block names becomes a free one (consistently, so URLs follow), each placeholder path
becomes a real one (:data:`PATHS`, made by the test), ``HEAD_IP`` is this machine, and a server
gets ``--host 127.0.0.1`` and a 256 MiB KV cache when it names no size. ``tokenmill serve`` and
``tokenmill router`` start in the background and are up once ``/health`` answers; when the block
sends no request itself, one completion goes to the last server started. A Ray cluster's "nodes"
are Ray processes on this machine (``ray start`` with a private temporary directory and token,
stopped by their process ids), each given 8 CPUs (``--num-cpus 8``) since the engine places one
bundle per rank and this machine has 2 cores.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from test_doc_commands import PYTHON_SLOW, ROOT, python_blocks, replace_llm, shell_blocks
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

STARTS = {
    "tokenmill serve --tensor-parallel-size 3": "3 worker processes of the default model",
    "tokenmill serve --pipeline-parallel-size 2": "2 pipeline stages of the default model",
    "tokenmill serve --data-parallel-size 2": "2 engine cores of the default model",
    "tokenmill serve --model /models/deepseek-v3": "expert parallelism on a tiny DeepSeek-V3",
    "ray start --head --port 6379": "a Ray cluster of two nodes on this machine, a tiny Llama",
    "tokenmill serve --port 8000 --kv-transfer-config": "a KV connector on the default model",
    "tokenmill serve --port 8100 --kv-transfer-config": "p2p prefill and decode instances and the router",
    "tokenmill serve --enable-lora": "PEFT adapters of the default model",
    "curl -X POST localhost:8000/v1/load_lora_adapter": "runtime adapter loading, on the LoRA server",
    "tokenmill serve --port 8000 --disable-web-ui": "the server without its web UI",
    "tokenmill bench throughput": "the documented sizes on the default model (and bench latency)",
    "python benchmarks/lora.py --kernel": "the kernel benchmark",
    "pytest --tokenmill-plugin example": "the conformance kit on the installed example",
    "WEB_UI_SCREENSHOT_DIR=": "the browser tests, screenshots in a temporary folder",
}
"""The start of a command -> what runs: each block's commands from the first command with such a
start to the block's end run here, in one test."""

DEFAULT_KV = "268435456"


def blocks_run_here() -> list[tuple[str, list[str]]]:
    """What this module runs: (``file: first command``, commands) for each block's commands from
    the first with a start in :data:`STARTS`."""
    found = []
    for name, commands in shell_blocks():
        first = next((i for i, c in enumerate(commands) if c.startswith(tuple(STARTS))), None)
        if first is not None:
            last = f" ... {commands[-1]}" if len(commands) > first + 1 else ""
            found.append((f"{name}: {commands[first]}{last}", commands[first:]))
    return found


def commands_run_here() -> set[str]:
    return {command for _, commands in blocks_run_here() for command in commands}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BlockRun:
    """One block's commands, run in order; servers and Ray processes stopped at the end."""

    def __init__(self, tmp: Path, paths: dict[str, str], env: dict[str, str]) -> None:
        self.tmp, self.paths, self.env = tmp, paths, env
        self.ports: dict[str, str] = {}
        self.servers: list[tuple[subprocess.Popen, str, Path]] = []
        self.ray_dir: str | None = None
        self.sent_request = False

    def substitute(self, command: str) -> str:
        for placeholder, real in self.paths.items():
            command = command.replace(placeholder, real)
        command = command.replace("HEAD_IP", "127.0.0.1").replace("localhost:", "127.0.0.1:")
        for port in re.findall(r"(?:--port[ =]|\"port\": |127\.0\.0\.1:)(\d{4,5})\b", command):
            self.ports.setdefault(port, str(free_port()))
        for port, free in self.ports.items():
            command = re.sub(rf"(?<=[ :=]){port}\b", free, command)
        return command

    def run(self, command: str) -> None:
        words = shlex.split(self.substitute(command))
        env = dict(self.env)
        while "=" in words[0] and not words[0].startswith("-"):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        if words[-1] == "&":
            words.pop()
        if words[:2] in (["tokenmill", "serve"], ["tokenmill", "router"]):
            self.start_server(words, env)
        elif words[:2] == ["ray", "start"]:
            self.ray_start(words, env)
        else:
            self.foreground(words, env)

    def _argv(self, words: list[str]) -> list[str]:
        head = {
            "tokenmill": [sys.executable, "-m", "tokenmill"],
            "pytest": [sys.executable, "-m", "pytest"],
            "ray": [sys.executable, "-m", "ray.scripts.scripts"],
        }
        if words[0] == "python":
            return [sys.executable, *words[1:]]
        return head.get(words[0], [words[0]]) + words[1:]

    def start_server(self, words: list[str], env: dict[str, str]) -> None:
        argv = self._argv(words) + ["--host", "127.0.0.1"]
        if "--port" not in words:
            argv += ["--port", str(free_port())]
        if words[1] == "serve" and "--kv-cache-memory-bytes" not in words:
            argv += ["--kv-cache-memory-bytes", DEFAULT_KV]
        url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
        self.stop([s for s in self.servers if s[1] == url])  # the same port: the doc's alternative
        log = self.tmp / f"server{len(self.servers)}.log"
        proc = subprocess.Popen(argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.servers.append((proc, url, log))
        deadline = time.monotonic() + 540
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"{' '.join(words)} exited:\n{log.read_text()[-4000:]}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{' '.join(words)} not healthy:\n{log.read_text()[-4000:]}")

    def ray_start(self, words: list[str], env: dict[str, str]) -> None:
        if self.ray_dir is None:
            self.ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
            self.env.update(
                RAY_TMPDIR=self.ray_dir, RAY_USAGE_STATS_ENABLED="0",
                RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
            )
            env.update(self.env)
        done = subprocess.run(
            [*self._argv(words), "--num-cpus", "8"],
            env=env, capture_output=True, text=True, timeout=300,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        if "--head" in words:
            self.env["RAY_ADDRESS"] = f"127.0.0.1:{words[words.index('--port') + 1]}"

    def foreground(self, words: list[str], env: dict[str, str]) -> None:
        in_project = any(w.startswith(("tests/", "benchmarks/")) for w in words)
        done = subprocess.run(
            self._argv(words), env=env, cwd=ROOT if in_project else self.tmp,
            capture_output=True, text=True, timeout=1800,
        )
        assert done.returncode == 0, f"{' '.join(words)}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        if words[0] == "curl":
            self.sent_request = True
            assert done.stdout.strip() and '"error"' not in done.stdout, done.stdout

    def complete(self) -> dict:
        _, url, _ = self.servers[-1]
        request = {"prompt": [1, 2, 3], "max_tokens": 4}  # token ids: the tiny models have no tokenizer
        response = httpx.post(url + "/v1/completions", json=request, timeout=300)
        assert response.status_code == 200, response.text
        return response.json()

    def stop(self, servers: list[tuple[subprocess.Popen, str, Path]]) -> None:
        for server in reversed(servers):
            server[0].terminate()
            try:
                server[0].wait(30)
            except subprocess.TimeoutExpired:
                server[0].kill()
                server[0].wait(10)
            self.servers.remove(server)

    def _uses_ray_dir(self, proc: psutil.Process) -> bool:
        """Whether ``proc`` is one of this block's Ray processes: its environment names the
        temporary directory or (an agent that retitled itself over its environment) it has a
        file open there."""
        assert self.ray_dir
        try:
            return proc.environ().get("RAY_TMPDIR") == self.ray_dir or any(
                f.path.startswith(self.ray_dir) for f in proc.open_files()
            )
        except psutil.Error:
            return False

    def close(self) -> None:
        self.stop(list(self.servers))
        if self.ray_dir:
            mine = [proc for proc in psutil.process_iter() if self._uses_ray_dir(proc)]
            for proc in mine:
                proc.terminate()
            for proc in psutil.wait_procs(mine, timeout=10)[1]:
                proc.kill()
            shutil.rmtree(self.ray_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def paths(tmp_path_factory, default_model_dir) -> dict[str, str]:
    """The docs' placeholder paths -> real ones made here."""
    from conftest import make_tiny_checkpoint
    from support.deepseek_checkpoints import save_deepseek
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("doc_paths")
    found = {
        "/models/my-model": make_tiny_checkpoint(root / "my-model"),
        "/models/deepseek-v3": save_deepseek(root / "deepseek-v3", "v3")[0],
        "/tmp/kv-store": str(root / "kv-store"),
        "/var/cache/tokenmill-kv": str(root / "tokenmill-kv"),
        "WEB_UI_SCREENSHOT_DIR=screenshots": f"WEB_UI_SCREENSHOT_DIR={root / 'screenshots'}",
    }
    for i, name in enumerate(("sql-adapter", "chat-adapter", "new-adapter")):
        base = AutoModelForCausalLM.from_pretrained(default_model_dir)
        config = LoraConfig(r=8 * (1 + i % 2), target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        get_peft_model(base, config).save_pretrained(str(root / name))
        found[f"/path/to/{name}"] = str(root / name)
    return found


@pytest.fixture
def block_run(tmp_path, paths, example_plugin_site) -> Iterator[BlockRun]:
    from plugins.test_conformance_kit import EXAMPLE_CONFTEST

    (tmp_path / "conftest.py").write_text(EXAMPLE_CONFTEST)
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENMILL_PLUGINS", "TOKENMILL_PLATFORM", "RAY_ADDRESS")}
    env["TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(example_plugin_site), str(ROOT / "tests" / "support"), env.get("PYTHONPATH", "")])
    run = BlockRun(tmp_path, paths, env)
    yield run
    run.close()


def _lora_server_block() -> list[str]:
    [commands] = [c for _, c in shell_blocks() if c and c[0].startswith("tokenmill serve --enable-lora")]
    return commands


@pytest.mark.parametrize(
    "commands", [pytest.param(c, id=re.sub(r"[^\w.=-]+", "_", label)[:90]) for label, c in blocks_run_here()]
)
def test_doc_block_runs(commands, block_run, paths):
    if commands[0].startswith("curl -X POST localhost:8000/v1/load_lora_adapter"):
        for command in _lora_server_block():
            block_run.run(command)
        block_run.ports["8000"] = block_run.servers[-1][1].rsplit(":", 1)[1]
    for command in commands:
        block_run.run(command)
    if block_run.servers and not block_run.sent_request:
        assert block_run.complete()["usage"]["completion_tokens"] > 0
    if "--disable-web-ui" in commands[-1]:
        assert httpx.get(block_run.servers[-1][1] + "/").status_code == 404
    if commands[0].startswith("WEB_UI_SCREENSHOT_DIR="):
        shots = Path(paths["WEB_UI_SCREENSHOT_DIR=screenshots"].split("=", 1)[1])
        assert sorted(p.name for p in shots.glob("*.png")), "the browser tests saved no screenshot"


@pytest.mark.parametrize("block", list(PYTHON_SLOW))
def test_python_block_runs(block, monkeypatch):
    """The block (which uses ``LLM`` as the page's earlier code imported it) builds its engine,
    with a 256 MiB KV cache, and the engine generates."""
    built: list[LLM] = []

    def build(**kwargs) -> LLM:
        built.append(LLM(**kwargs, kv_cache_memory_bytes=int(DEFAULT_KV)))
        return built[-1]

    replace_llm(monkeypatch, build)
    namespace: dict = {"LLM": build}
    try:
        exec(compile(python_blocks()[block], block, "exec"), namespace)
        out = namespace["llm"].generate(
            "The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
        )
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        for llm in built:
            llm.llm_engine.engine_core.shutdown()
