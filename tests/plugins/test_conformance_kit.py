"""The plugin conformance kit (``pytest --tokenmill-...``): tokenmill's own CPU parts and the
example plugin's pass it; deliberately broken parts fail it at the contract point they break."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1] / "support"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def doc_hook(name: str) -> str:
    """The ```python block of docs/plugins.md that defines the kit hook ``name``."""
    [block] = [b for b in re.findall(r"^```python\n(.*?)^```", DOCS.read_text(), re.S | re.M) if f"def {name}(" in b]
    return block

BROKEN_CONFTEST = """
from tokenmill import plugins

plugins.register_attention_backend("wrong-slot", "kit_broken_parts:WrongSlotBackend")
plugins.register_attention_backend("no-gqa", "kit_broken_parts:NoGqaBackend")
plugins.register_attention_backend("wrong-slot-mla", "kit_broken_parts:WrongSlotMLABackend")
plugins.register_attention_backend("no-rope-mla", "kit_broken_parts:NoRopeMLABackend")
plugins.register_platform("unregistered-candidate", "kit_broken_parts:UnregisteredCandidatePlatform")
plugins.register_model("LlamaForCausalLM", "kit_broken_parts:RopeOffByOne")
plugins.register_proposer("corrupting", "kit_broken_parts:CorruptingProposer")
plugins.register_quantization_method("neighbour-scale", "kit_broken_parts:NeighbourScaleInt8")
plugins.register_quantization_method("keeps-float", "kit_broken_parts:KeepsFloatInt8")
"""


def run_kit(cwd: Path, *args: str, pythonpath: list[Path] = ()) -> subprocess.CompletedProcess:
    """``pytest <kit options>`` in ``cwd`` (outside this project's tests), in a fresh process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")])
    for var in ("TOKENMILL_PLATFORM", "TOKENMILL_ATTENTION_BACKEND", "TOKENMILL_PLUGINS"):
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", *args],
        cwd=cwd, env=env, capture_output=True, text=True,
    )


def summary(out: str) -> dict[str, str]:
    """The kit's report: ``"<kind> '<name>'"`` -> its "N of M contract points passed" line."""
    lines = out.split("tokenmill conformance", 1)[1].splitlines()
    return {
        line.split(":")[0]: line.split(": ", 1)[1]
        for line in lines
        if " contract points passed" in line
    }


FIRST_PARTY_CONFTEST = """
from pathlib import Path

from deepseek_checkpoints import save_deepseek, write_mtp_checkpoint as save_tiny_deepseek_v3_with_mtp
from eagle_heads import write_eagle_head

VERSIONS = {"DeepseekV2ForCausalLM": "v2", "DeepseekV3ForCausalLM": "v3"}


def pytest_tokenmill_tiny_checkpoint(arch, path):
    if arch in VERSIONS:
        return Path(save_deepseek(path, VERSIONS[arch])[0])


def pytest_tokenmill_speculative_config(method, model_path, prompts):
    if method == "eagle":
        return {"method": method, "model": write_eagle_head(model_path.parent / "eagle_head", model_path)}
""" + doc_hook("pytest_tokenmill_proposer_target")
"""The kit's hooks for the DeepSeek models, whose transformers defaults are far from tiny, for
a random EAGLE-1 head and (docs/plugins.md's) for the ``mtp`` proposer's DeepSeek-V3 target."""

CAUSAL_LMS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
"""The first-party models the kit checks (not ``DeepSeekMTPModel``: a draft module, no LM)."""

MLA_BACKENDS = ("torch_mla", "cpu_mla", "triton_mla")
"""The first-party MLA backends that run on the CPU (``triton_mla`` under ``TRITON_INTERPRET=1``,
which tests/conftest.py sets without a GPU)."""

ONLINE_QUANTIZATION = ("int8", "w8a8", "int4", "fp8")
"""The first-party quantization methods that quantize float weights (the others load
pre-quantized checkpoints only; tests/quant/test_quant_checkpoints.py covers them)."""


def test_first_party_cpu_parts_pass(tmp_path):
    (tmp_path / "conftest.py").write_text(FIRST_PARTY_CONFTEST)
    models = [arg for arch in CAUSAL_LMS for arg in ("--tokenmill-model", arch)]
    result = run_kit(
        tmp_path,
        "--tokenmill-backend", "torch", "--tokenmill-backend", "cpu_sdpa",
        *[arg for name in MLA_BACKENDS for arg in ("--tokenmill-backend", name)],
        "--tokenmill-platform", "cpu",
        *models,
        "--tokenmill-proposer", "ngram", "--tokenmill-proposer", "draft_model",
        *[arg for method in ONLINE_QUANTIZATION for arg in ("--tokenmill-quantization", method)],
        "--tokenmill-proposer", "eagle", "--tokenmill-proposer", "mtp",
        pythonpath=[TESTS],
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    report = summary(result.stdout)
    assert report == {
        "attention backend 'torch'": "6 of 6 contract points passed",
        "attention backend 'cpu_sdpa'": "6 of 6 contract points passed",
        **{f"attention backend '{name}'": "5 of 5 contract points passed" for name in MLA_BACKENDS},
        "platform 'cpu'": "5 of 5 contract points passed",
        "model 'LlamaForCausalLM'": "5 of 5 contract points passed",
        "model 'MistralForCausalLM'": "5 of 5 contract points passed",
        "model 'Qwen2ForCausalLM'": "5 of 5 contract points passed",
        "model 'DeepseekV2ForCausalLM'": "5 of 5 contract points passed",
        "model 'DeepseekV3ForCausalLM'": "5 of 5 contract points passed",
        "proposer 'ngram'": "4 of 4 contract points passed",
        "proposer 'draft_model'": "4 of 4 contract points passed",
        **{f"quantization method '{m}'": "5 of 5 contract points passed" for m in ONLINE_QUANTIZATION},
        "proposer 'eagle'": "4 of 4 contract points passed",
        "proposer 'mtp'": "4 of 4 contract points passed",
    }, result.stdout[-4000:]


MY_MODEL_CONFTEST = """
from tokenmill import plugins
from tokenmill.testing.checkpoints import save_tiny_checkpoint

plugins.register_model("MyModelForCausalLM", "tokenmill.models.llama:LlamaForCausalLM")


def save_my_tiny_model(path):
    save_tiny_checkpoint("LlamaForCausalLM", path)
    config = path / "config.json"
    config.write_text(config.read_text().replace('"LlamaForCausalLM"', '"MyModelForCausalLM"'))
"""
"""A model only the author can save a checkpoint of (a Llama under a name transformers lacks)."""

EXAMPLE_CONFTEST = doc_hook("pytest_tokenmill_speculative_config") + MY_MODEL_CONFTEST + doc_hook(
    "pytest_tokenmill_tiny_checkpoint"
)
"""docs/plugins.md's hooks: the example's ``corpus-lookup`` proposer gets the kit's own prompts as
its corpus, and ``MyModelForCausalLM`` its tiny checkpoint."""


def test_example_plugin_passes(tmp_path, example_plugin_site):
    (tmp_path / "conftest.py").write_text(EXAMPLE_CONFTEST)
    result = run_kit(
        tmp_path, "--tokenmill-plugin", "example", "--tokenmill-model", "MyModelForCausalLM",
        pythonpath=[example_plugin_site],
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert summary(result.stdout) == {
        "attention backend 'example-hnd'": "6 of 6 contract points passed",
        "platform 'example'": "5 of 5 contract points passed",
        "model 'GPT2LMHeadModel'": "5 of 5 contract points passed",
        "model 'MyModelForCausalLM'": "4 of 5 contract points passed",  # transformers lacks it
        "proposer 'corpus-lookup'": "4 of 4 contract points passed",
        "plugin 'example'": "1 of 1 contract points passed",
    }, result.stdout[-4000:]


LEAKY_PLUGIN = {
    "leaky_plugin/__init__.py": (
        "from tokenmill import hookimpl\n\n\n"
        "@hookimpl\n"
        "def register_tool_parsers(register):\n"
        "    register('leaky', 'leaky_plugin.parser:LeakyParser')\n"
    ),
    "leaky_plugin/parser.py": (
        "from tokenmill.interfaces import Platform\n\n\n"
        "class LeakyParser:\n"
        "    def batch(self):\n"
        "        from tokenmill.worker.input_batch import InputBatch\n\n"
        "        return InputBatch\n"
    ),
    "leaky_plugin-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: leaky-plugin\nVersion: 0.1\n",
    "leaky_plugin-0.1.dist-info/entry_points.txt": "[tokenmill.plugins]\nleaky = leaky_plugin\n",
}
"""An installed distribution whose plugin reaches into ``tokenmill.worker`` (lazily)."""


def test_plugin_importing_internals_fails_the_imports_point(tmp_path):
    site = tmp_path / "site"
    for name, text in LEAKY_PLUGIN.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    result = run_kit(tmp_path, "--tokenmill-plugin", "leaky", pythonpath=[site])
    out = result.stdout
    assert result.returncode == 1, out[-6000:] + result.stderr[-3000:]
    assert summary(out) == {"plugin 'leaky'": "0 of 1 contract points passed"}, out[-4000:]
    assert "FAILED" in out and "test_imports_only_the_public_api[leaky]" in out
    assert "leaky_plugin.parser -> tokenmill.worker.input_batch (line 6)" in out, out[-4000:]


@pytest.mark.parametrize(
    "option,message",
    [
        ("--tokenmill-plugin", "no installed tokenmill plugin named nope"),
        ("--tokenmill-model", "no registered model named nope"),
    ],
)
def test_unknown_part_is_a_usage_error(tmp_path, option, message):
    result = run_kit(tmp_path, option, "nope")
    assert result.returncode == 4, result.stdout + result.stderr
    assert message in result.stderr + result.stdout


def test_unimportable_backend_is_a_usage_error(tmp_path):
    """The kit loads a backend to pick its suite (MLA or not): a target that does not import
    stops the run with the registry's message."""
    (tmp_path / "conftest.py").write_text(
        "from tokenmill import plugins\n"
        "plugins.register_attention_backend('missing', 'no_such_module:Backend')\n"
    )
    result = run_kit(tmp_path, "--tokenmill-backend", "missing")
    assert result.returncode == 4, result.stdout + result.stderr
    assert "cannot import attention backend 'missing'" in result.stderr + result.stdout


def test_broken_parts_fail_at_their_contract_point(tmp_path):
    (tmp_path / "conftest.py").write_text(BROKEN_CONFTEST)
    result = run_kit(
        tmp_path,
        "--tokenmill-backend", "wrong-slot", "--tokenmill-backend", "no-gqa",
        "--tokenmill-backend", "wrong-slot-mla", "--tokenmill-backend", "no-rope-mla",
        "--tokenmill-platform", "unregistered-candidate",
        "--tokenmill-model", "LlamaForCausalLM",
        "--tokenmill-proposer", "corrupting",
        "--tokenmill-quantization", "neighbour-scale", "--tokenmill-quantization", "keeps-float",
        pythonpath=[TESTS],
    )
    out = result.stdout
    assert result.returncode == 1, out[-6000:] + result.stderr[-3000:]
    failed = {line.split(" - ")[0].split("::")[-1] for line in out.splitlines() if line.startswith("FAILED")}
    assert failed == {
        "test_writes_kv_where_slot_mapping_says[wrong-slot]",
        "test_matches_reference_on_mixed_batches[wrong-slot]",
        "test_sliding_window[wrong-slot]",
        "test_matches_reference_on_mixed_batches[no-gqa]",
        "test_sliding_window[no-gqa]",
        "test_writes_latent_where_slot_mapping_says[wrong-slot-mla]",
        "test_matches_reference_on_mixed_batches[wrong-slot-mla]",
        "test_matches_reference_on_mixed_batches[no-rope-mla]",
        "test_candidates_are_registered_backends[unregistered-candidate]",
        "test_greedy_equals_cpu_platform[unregistered-candidate]",
        "test_greedy_matches_transformers[LlamaForCausalLM]",
        "test_greedy_unchanged[corrupting-plain]",
        "test_greedy_unchanged[corrupting-chunked-prefill]",
        "test_greedy_unchanged[corrupting-preemption]",
        "test_output_matches_dequantized_matmul[neighbour-scale-1]",
        "test_output_matches_dequantized_matmul[neighbour-scale-3]",
        "test_output_matches_dequantized_matmul[neighbour-scale-48]",
        "test_loaded_memory_below_float[keeps-float]",
    }, out[-6000:]
    for message in (
        "the cache differs from the reference after the K/V writes",
        "attention output differs from the reference backend",
        "the cache differs from the reference after the latent writes",
        "attention output differs from the reference backend 'torch_mla'",
        "name unregistered backend(s) ['no-such-backend']",
        "greedy tokens differ from transformers on prompt 0",
        "changed the greedy tokens of prompt",
        "layer output differs from dequantize-then-matmul",
        "bytes of weights, float32 needs",
    ):
        assert message in out, message
    report = summary(out)
    assert report["attention backend 'no-gqa'"] == "4 of 6 contract points passed"
    assert report["attention backend 'no-rope-mla'"] == "4 of 5 contract points passed"
    assert report["model 'LlamaForCausalLM'"] == "4 of 5 contract points passed"
    assert report["quantization method 'neighbour-scale'"] == "2 of 5 contract points passed"
    assert report["quantization method 'keeps-float'"] == "4 of 5 contract points passed"


KV_CONNECTOR_CONFTEST = """
def pytest_tokenmill_kv_transfer_config(name, path):
    if name == "storage":
        return {"kv_connector": name, "kv_connector_extra_config": {"shared_storage_path": str(path)}}
"""
"""The ``storage`` connector needs a directory; ``offload`` runs on its defaults (a host tier)."""


def test_first_party_kv_connectors_pass(tmp_path):
    (tmp_path / "conftest.py").write_text(KV_CONNECTOR_CONFTEST)
    result = run_kit(tmp_path, "--tokenmill-kv-connector", "storage", "--tokenmill-kv-connector", "offload")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert summary(result.stdout) == {
        "KV connector 'storage'": "3 of 3 contract points passed",
        "KV connector 'offload'": "3 of 3 contract points passed",
    }, result.stdout[-4000:]


BROKEN_CONNECTORS_CONFTEST = """
from tokenmill import plugins

plugins.register_kv_connector("loads-into-neighbour", "kit_broken_connectors:LoadsIntoNeighbour")
plugins.register_kv_connector("loads-when-asked", "kit_broken_connectors:LoadsWhenAsked")
plugins.register_kv_connector("never-sends", "kit_broken_connectors:NeverSends")
"""


def test_broken_kv_connectors_fail_at_their_contract_point(tmp_path):
    (tmp_path / "conftest.py").write_text(BROKEN_CONNECTORS_CONFTEST)
    names = ("loads-into-neighbour", "loads-when-asked", "never-sends")
    result = run_kit(tmp_path, *[a for n in names for a in ("--tokenmill-kv-connector", n)], pythonpath=[TESTS])
    out = result.stdout
    assert result.returncode == 1, out[-6000:] + result.stderr[-3000:]
    failed = {line.split(" - ")[0].split("::")[-1] for line in out.splitlines() if line.startswith("FAILED")}
    assert failed == {
        "test_save_then_load_round_trips[loads-into-neighbour]",
        "test_matching_has_no_side_effects[loads-when-asked]",
        "test_save_then_load_round_trips[never-sends]",
        "test_matching_has_no_side_effects[never-sends]",
        "test_blocks_released_after_request_finished[never-sends]",
    }, out[-4000:]
