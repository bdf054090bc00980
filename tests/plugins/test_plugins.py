"""The plugin framework: entry-point discovery, ``TOKENMILL_PLUGINS``, errors that name the plugin
and its distribution, runtime registration and name lookups.

Fake distributions are a module plus a ``*.dist-info`` (METADATA, entry_points.txt) written to a
temporary directory on ``sys.path``, which ``importlib.metadata`` discovers like installed ones.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import re
import shutil
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_checkpoint
from tokenmill import LLM, SamplingParams, cli, plugins
from tokenmill.attention_backends.torch_ref import TorchRefBackend
from tokenmill import ModelRegistry
from tokenmill.interfaces import AttentionConfig, Platform
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.platforms.cpu import CpuPlatform
from tokenmill.plugins import PluginError
from tokenmill.selector import select_attention_backend, select_platform

DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
ENV_VARS = ("TOKENMILL_PLUGINS", "TOKENMILL_PLATFORM", "TOKENMILL_ATTENTION_BACKEND")
ATTN = AttentionConfig(head_size=16, dtype=torch.float32)

PARTS_MODULE = """
from tokenmill.interfaces import AttentionBackend, Platform

class FakePlatform(Platform):
    name = "fake"

class FakeBackend(AttentionBackend):
    @classmethod
    def validate_configuration(cls, config):
        return ["fake reason"]

class FakeModel: ...

class FakeProposer: ...

class FakeQuant: ...
"""

HOOKS_MODULE = """
from tokenmill.plugins import hookimpl

@hookimpl
def register_platforms(register):
    register("fake", "fake_tm_parts:FakePlatform")

@hookimpl
def register_attention_backends(register):
    register("fake-attn", "fake_tm_parts:FakeBackend")

@hookimpl
def register_models(register):
    register("FakeForCausalLM", "fake_tm_parts:FakeModel")

@hookimpl
def register_proposers(register):
    register("fake-spec", "fake_tm_parts:FakeProposer")

@hookimpl
def register_quantization_methods(register):
    register("fake-quant", "fake_tm_parts:FakeQuant")
"""

FAKE_PARTS = {
    "platforms": ("fake", "fake_tm_parts:FakePlatform"),
    "attention_backends": ("fake-attn", "fake_tm_parts:FakeBackend"),
    "models": ("FakeForCausalLM", "fake_tm_parts:FakeModel"),
    "proposers": ("fake-spec", "fake_tm_parts:FakeProposer"),
    "quantization_methods": ("fake-quant", "fake_tm_parts:FakeQuant"),
}


class FakeSite:
    """A ``sys.path`` directory to write fake distributions into."""

    def __init__(self, root: Path, mp: pytest.MonkeyPatch) -> None:
        self.root = root
        self.mp = mp
        self.modules: list[str] = []

    def install(
        self, dist: str, entry_point: str, modules: dict[str, str], ep_name: str = "fake"
    ) -> None:
        """Write ``modules`` (name -> source) and a distribution ``dist`` whose entry point
        ``ep_name`` names ``entry_point``."""
        for name, source in modules.items():
            (self.root / f"{name}.py").write_text(textwrap.dedent(source))
            self.modules.append(name)
        info = self.root / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[tokenmill.plugins]\n{ep_name} = {entry_point}\n")
        importlib.invalidate_caches()


@pytest.fixture
def site(tmp_path) -> Iterator[FakeSite]:
    """No plugin environment variables or runtime registrations; restored and reloaded after."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ENV_VARS:
            mp.delenv(var, raising=False)
        mp.setattr(plugins, "_runtime", [])
        mp.syspath_prepend(str(tmp_path))
        fake = FakeSite(tmp_path, mp)
        yield fake
        for name in fake.modules:
            sys.modules.pop(name, None)
    importlib.invalidate_caches()
    plugins.reload_plugins()


@pytest.fixture
def fake_plugin(site):
    modules = {"fake_tm_hooks": HOOKS_MODULE, "fake_tm_parts": PARTS_MODULE}
    site.install("fake-tm-plugin", "fake_tm_hooks", modules)
    return site


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"))


def test_fake_plugin_fills_every_registry(fake_plugin):
    plugins.reload_plugins()
    for kind, (name, target) in FAKE_PARTS.items():
        reg = plugins.get_registry(kind).get(name)
        assert (reg.target, reg.plugin, reg.distribution) == (target, "fake", "fake-tm-plugin")
    assert "fake_tm_parts" not in sys.modules, "targets are imported only when chosen"
    assert plugins.get_registry("platforms").load("fake").__name__ == "FakePlatform"
    assert "cpu" in plugins.get_registry("platforms")


def test_cli_lists_fake_plugin(fake_plugin, capsys):
    plugins.reload_plugins()
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    for name, target in FAKE_PARTS.values():
        assert target in lines[name] and "from fake-tm-plugin" in lines[name]
    assert "[not available]" in lines["fake"]
    assert "[unavailable: fake reason]" in lines["fake-attn"]


@pytest.mark.parametrize(
    "allowed, present, absent",
    [
        ("fake", ["fake"], ["cpu"]),
        (" platforms , models ", ["cpu"], ["fake"]),
    ],
)
def test_tokenmill_plugins_filters_entry_points(fake_plugin, allowed, present, absent):
    fake_plugin.mp.setenv("TOKENMILL_PLUGINS", allowed)
    plugins.reload_plugins()
    names = plugins.get_registry("platforms").names()
    assert all(n in names for n in present) and not any(n in names for n in absent)


BROKEN_PREFIX = "plugin 'broken' from distribution 'broken-dist' "
HOOKS = "register_platforms, register_attention_backends, register_models, register_proposers, " \
    "register_quantization_methods, register_commands, register_tool_parsers, register_kv_connectors"

BROKEN = {
    "import-error": (
        "broken_tm",
        "import missing_dependency_xyz\n",
        "failed to load (broken_tm): No module named 'missing_dependency_xyz'",
    ),
    "missing-module": (
        "broken_tm_missing",
        None,
        "failed to load (broken_tm_missing): No module named 'broken_tm_missing'",
    ),
    "hook-raises": (
        "broken_tm",
        """
        from tokenmill.plugins import hookimpl

        @hookimpl
        def register_platforms(register):
            register("half", "broken_tm:HalfPlatform")

        @hookimpl
        def register_models(register):
            raise RuntimeError("boom")
        """,
        "failed in register_models: boom",
    ),
    "bad-target": (
        "broken_tm",
        """
        from tokenmill.plugins import hookimpl

        @hookimpl
        def register_models(register):
            register("Broken", "no_colon_here")
        """,
        "registered 'Broken' -> 'no_colon_here'; expected register(name, 'module:Class')",
    ),
    "bad-hook-signature": (
        "broken_tm",
        """
        from tokenmill.plugins import hookimpl

        @hookimpl
        def register_models(registry):
            pass
        """,
        "is not a valid tokenmill plugin: Plugin 'broken' for hook 'register_models'\n"
        "hookimpl definition: register_models(registry)\n"
        "Argument(s) {'registry'} are declared in the hookimpl but can not be found in the "
        f"hookspec (the hooks are {HOOKS})",
    ),
    "misspelled-hook": (
        "broken_tm",
        """
        from tokenmill.plugins import hookimpl

        @hookimpl
        def register_model(register):
            pass
        """,
        "is not a valid tokenmill plugin: unknown hook 'register_model' in plugin "
        f"<module 'broken_tm' from '{{root}}/broken_tm.py'> (the hooks are {HOOKS})",
    ),
}


def _install_broken(site: FakeSite, case: str) -> str:
    """Install the ``BROKEN`` case as plugin 'broken' of 'broken-dist'; return its error."""
    module, source, message = BROKEN[case]
    site.install("broken-dist", module, {module: source} if source else {}, ep_name="broken")
    return BROKEN_PREFIX + message.replace("{root}", str(site.root))


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_plugin_is_an_error_naming_it(site, case):
    message = _install_broken(site, case)
    with pytest.raises(PluginError) as err:
        plugins.reload_plugins()
    assert str(err.value) == message
    with pytest.raises(PluginError) as err:
        plugins.get_registry("models")
    assert str(err.value) == message


@pytest.mark.parametrize("case", list(BROKEN))
def test_plugins_command_lists_healthy_parts_and_the_broken_plugin(site, case, capsys):
    message = _install_broken(site, case)
    with pytest.raises(PluginError):
        plugins.reload_plugins()
    assert cli.main(["plugins"]) == 1
    out = capsys.readouterr().out
    names = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert {"cpu", "torch", "LlamaForCausalLM"} <= set(names)
    assert "half" not in names, "a failing plugin leaves none of its parts registered"
    indented = message.replace("\n", "\n    ")
    assert out.endswith(
        f"broken plugins (no engine starts until they are fixed or uninstalled):\n  {indented}\n"
    )


def test_generate_with_a_broken_plugin_is_an_error_not_a_traceback(site, tiny_llama, capsys):
    message = _install_broken(site, "misspelled-hook")
    with pytest.raises(PluginError):
        plugins.reload_plugins()
    assert cli.main(["generate", "x", "--model", tiny_llama]) == 2
    assert capsys.readouterr().err.strip().endswith(f"error: {message}")


def _help(capsys) -> str:
    """What ``tokenmill --help`` prints."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert [a.dest for a in action._choices_actions] == list(action.choices), "help and choices"
    return action.choices


@pytest.mark.parametrize("case", list(BROKEN))
def test_help_lists_the_commands_and_the_broken_plugin(site, case, capsys):
    message = _install_broken(site, case)
    with pytest.raises(PluginError):
        plugins.reload_plugins()
    assert {"generate", "chat", "plugins", "bench", "serve"} <= set(_commands(cli.build_parser()))
    indented = message.replace("\n", "\n    ")
    assert _help(capsys).endswith(f"broken plugins (see 'tokenmill plugins'):\n  {indented}\n")


COMMANDS_MODULE = """
from tokenmill.plugins import hookimpl

def add_ok(subparsers):
    subparsers.add_parser("fake-ok", help="works").set_defaults(func=lambda args: 7)

def add_raises(subparsers):
    subparsers.add_parser("fake-raises", help="half added")
    raise RuntimeError("boom")

def add_nothing(subparsers):
    pass

@hookimpl
def register_commands(register):
    register("fake-ok", "fake_tm_commands:add_ok")
    register("fake-raises", "fake_tm_commands:add_raises")
    register("fake-silent", "fake_tm_commands:add_nothing")
    register("fake-missing", "fake_tm_nowhere:add")
    register("generate", "fake_tm_commands:add_ok")
"""


def test_broken_commands_are_left_out_and_reported(site, capsys):
    site.install("fake-cmd-dist", "fake_tm_commands", {"fake_tm_commands": COMMANDS_MODULE})
    plugins.reload_plugins()
    commands = _commands(cli.build_parser())
    assert {"generate", "chat", "plugins", "bench", "serve", "router", "fake-ok"} == set(commands)
    assert commands["generate"].get_default("func") is cli.cmd_generate
    assert cli.main(["fake-ok"]) == 7
    left_out = "from plugin 'fake' (distribution 'fake-cmd-dist') is left out"
    errors = [
        "cannot import command 'fake-missing' (fake_tm_nowhere:add) registered by plugin 'fake' "
        "from distribution 'fake-cmd-dist': No module named 'fake_tm_nowhere'",
        f"command 'fake-raises' {left_out}: boom",
        f"command 'fake-silent' {left_out}: fake_tm_commands:add_nothing added no subcommand "
        "'fake-silent'",
        f"command 'generate' {left_out}: another command has that name",
    ]
    out = _help(capsys)
    listed = "\n  ".join(errors)
    assert out.endswith(f"broken plugins (see 'tokenmill plugins'):\n  {listed}\n")


def test_plugins_command_lists_unimportable_platform(site, capsys):
    site.install(
        "ghost-dist",
        "ghost_tm",
        {
            "ghost_tm": """
            from tokenmill.plugins import hookimpl

            @hookimpl
            def register_platforms(register):
                register("ghost", "ghost_tm_nowhere:GhostPlatform")
            """
        },
        ep_name="ghost",
    )
    plugins.reload_plugins()
    assert cli.main(["plugins"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["ghost"].endswith("[unavailable: No module named 'ghost_tm_nowhere']")


def test_misspelled_tokenmill_plugins_names_the_unknown_and_installed_plugins(site, capsys):
    site.mp.setenv("TOKENMILL_PLUGINS", "platfroms, models")
    message = (
        "TOKENMILL_PLUGINS names unknown plugin(s) 'platfroms'; "
        "installed plugins: attention_backends, commands, kv_connectors, models, platforms, "
        "quantization, spec_decode, tool_parsers"
    )
    with pytest.raises(ValueError) as err:
        plugins.reload_plugins()
    assert str(err.value) == message
    assert cli.main(["plugins"]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert _help(capsys).endswith(f"broken plugins (see 'tokenmill plugins'):\n  {message}\n")


FILTERED = (
    "(TOKENMILL_PLUGINS='models' excluded the plugin(s) attention_backends, commands, "
    "kv_connectors, platforms, quantization, spec_decode, tool_parsers)"
)
EXCLUDED_BY_FILTER = {
    "auto": (RuntimeError, lambda model: select_platform(), "no available platform among none"),
    "LLM": (RuntimeError, lambda model: LLM(model=model), "no available platform among none"),
    "named": (
        ValueError, lambda model: select_platform("cpu"), "unknown platform 'cpu'; registered: none"
    ),
    "backend": (
        ValueError,
        lambda model: select_attention_backend(CpuPlatform, ATTN, "torch"),
        "unknown attention backend 'torch'; registered: none",
    ),
}


@pytest.mark.parametrize("case", list(EXCLUDED_BY_FILTER))
def test_error_says_when_tokenmill_plugins_excluded_the_parts(site, tiny_llama, case):
    error, choose, message = EXCLUDED_BY_FILTER[case]
    site.mp.setenv("TOKENMILL_PLUGINS", "models")
    plugins.reload_plugins()
    with pytest.raises(error) as err:
        choose(tiny_llama)
    assert str(err.value) == f"{message} {FILTERED}"


def test_unimportable_target_fails_when_chosen_naming_plugin(site):
    site.install(
        "broken-dist",
        "broken_tm",
        {
            "broken_tm": """
            from tokenmill.plugins import hookimpl

            @hookimpl
            def register_models(register):
                register("BrokenForCausalLM", "broken_tm_nowhere:Model")
            """
        },
        ep_name="broken",
    )
    plugins.reload_plugins()
    with pytest.raises(PluginError, match="plugin 'broken' from distribution 'broken-dist'"):
        ModelRegistry.resolve(["BrokenForCausalLM"])


def test_same_part_name_from_two_plugins_is_an_error(fake_plugin):
    fake_plugin.install(
        "other-dist",
        "other_tm",
        {
            "other_tm": """
            from tokenmill.plugins import hookimpl

            @hookimpl
            def register_models(register):
                register("FakeForCausalLM", "other_tm:Model")
            """
        },
        ep_name="other",
    )
    with pytest.raises(PluginError, match="'FakeForCausalLM' registered twice") as err:
        plugins.reload_plugins()
    assert "fake-tm-plugin" in str(err.value) and "other-dist" in str(err.value)


def test_same_plugin_name_from_two_distributions_is_an_error(fake_plugin):
    fake_plugin.install("other-dist", "other_tm", {"other_tm": "\n"}, ep_name="fake")
    with pytest.raises(PluginError, match="plugin name 'fake' is used by distribution") as err:
        plugins.reload_plugins()
    assert "fake-tm-plugin" in str(err.value) and "other-dist" in str(err.value)


@pytest.mark.parametrize("auto_selectable", [True, False])
def test_available_out_of_tree_platform_wins_unless_not_auto_selectable(site, auto_selectable):
    builtin_default = select_platform().name
    site.install(
        "avail-dist",
        "avail_tm",
        {
            "avail_tm": f"""
            from tokenmill.interfaces import Platform
            from tokenmill.plugins import hookimpl

            class AvailPlatform(Platform):
                name = "avail"

                @classmethod
                def is_available(cls):
                    return True

                @classmethod
                def is_auto_selectable(cls):
                    return {auto_selectable}

            @hookimpl
            def register_platforms(register):
                register("avail", "avail_tm:AvailPlatform")
            """
        },
    )
    plugins.reload_plugins()
    assert select_platform().name == ("avail" if auto_selectable else builtin_default)
    assert select_platform("avail").name == "avail"


def _local_class(base: type) -> type:
    class Local(base):
        """Defined in a function: reachable as a class, not by a ``module:Class`` path."""

    return Local


def _renamed_checkpoint(src: str, dst: Path, arch: str) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = [arch]
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.mark.parametrize(
    "register", [plugins.register_model, ModelRegistry.register_model], ids=["plugins", "vllm"]
)
@pytest.mark.parametrize("as_class", [False, True], ids=["path", "class"])
def test_runtime_model_registration(site, tiny_llama, tmp_path, tokenmill_log, as_class, register):
    model_cls = _local_class(LlamaForCausalLM) if as_class else LlamaForCausalLM
    target = model_cls if as_class else "tokenmill.models.llama:LlamaForCausalLM"
    register("MyLlamaForCausalLM", target)
    plugins.reload_plugins()  # runtime registrations survive a reload
    assert "MyLlamaForCausalLM" in ModelRegistry.supported_archs()
    reg = plugins.get_registry("models").get("MyLlamaForCausalLM")
    assert reg.distribution == plugins.RUNTIME
    assert reg.target == f"{model_cls.__module__}:{model_cls.__qualname__}"
    resolved = ModelRegistry.resolve(["Unknown", "MyLlamaForCausalLM"])
    assert resolved == (model_cls, "MyLlamaForCausalLM")

    model_dir = _renamed_checkpoint(tiny_llama, tmp_path / "my_llama", "MyLlamaForCausalLM")
    tokenmill_log.clear()
    llm = LLM(model=model_dir, num_kv_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    message = f"using model 'MyLlamaForCausalLM': {reg.target} registered at run time"
    assert ("tokenmill.plugins", logging.INFO, message) in tokenmill_log


@pytest.mark.parametrize("as_class", [False, True], ids=["path", "class"])
def test_runtime_registration_of_every_kind(site, as_class):
    parts = {
        "platform": ("cpu-again", CpuPlatform, "tokenmill.platforms.cpu:CpuPlatform"),
        "attention_backend": (
            "torch-again",
            TorchRefBackend,
            "tokenmill.attention_backends.torch_ref:TorchRefBackend",
        ),
        "model": ("MyLlama", LlamaForCausalLM, "tokenmill.models.llama:LlamaForCausalLM"),
        "proposer": ("my-spec", _local_class(object), "somewhere:Proposer"),
        "quantization_method": ("my-quant", _local_class(object), "somewhere:Method"),
    }
    for kind, (name, cls, path) in parts.items():
        getattr(plugins, f"register_{kind}")(name, cls if as_class else path)
    assert select_platform("cpu-again") is CpuPlatform
    assert select_attention_backend(CpuPlatform, ATTN, "torch-again") is TorchRefBackend
    assert ModelRegistry.resolve(["MyLlama"]) == (LlamaForCausalLM, "MyLlama")
    assert "my-spec" in plugins.get_registry("proposers")
    assert "my-quant" in plugins.get_registry("quantization_methods")
    if as_class:
        assert plugins.get_registry("proposers").load("my-spec") is parts["proposer"][1]


def test_engine_logs_where_its_parts_come_from(site, tiny_llama, tokenmill_log):
    LLM(model=tiny_llama, num_kv_blocks=16)
    source = "from plugin '{}' (distribution 'tokenmill')"
    expected = [
        "using platform 'cpu': tokenmill.platforms.cpu:CpuPlatform " + source.format("platforms"),
        "using model 'LlamaForCausalLM': tokenmill.models.llama:LlamaForCausalLM "
        + source.format("models"),
        # chosen per attention layer while the model is built
        "using attention backend 'cpu_sdpa': tokenmill.attention_backends.cpu_sdpa:CpuSdpaBackend "
        + source.format("attention_backends"),
    ]
    logged = [(level, msg) for name, level, msg in tokenmill_log if name == "tokenmill.plugins"]
    assert logged == [(logging.DEBUG, message) for message in expected]


def test_runtime_registration_rejects_bad_input(site):
    with pytest.raises(ValueError, match="'no_colon' must be 'module:Class' or a class"):
        ModelRegistry.register_model("X", "no_colon")
    with pytest.raises(ValueError, match="42 must be 'module:Class' or a class"):
        plugins.register_platform("x", 42)
    with pytest.raises(ValueError, match="unknown plugin kind 'widgets'"):
        plugins.register("widgets", "x", "a:B")


UNKNOWN_NAMES = {
    "platform": ({}, lambda model: select_platform("nope")),
    "TOKENMILL_PLATFORM": ({"TOKENMILL_PLATFORM": "nope"}, lambda model: select_platform()),
    "backend": ({}, lambda model: select_attention_backend(CpuPlatform, ATTN, "nope")),
    "TOKENMILL_ATTENTION_BACKEND": (
        {"TOKENMILL_ATTENTION_BACKEND": "nope"},
        lambda model: select_attention_backend(CpuPlatform, ATTN),
    ),
    "LLM-platform": ({}, lambda model: LLM(model=model, platform="nope")),
    "LLM-backend": ({}, lambda model: LLM(model=model, attention_backend="nope", num_kv_blocks=16)),
}


@pytest.mark.parametrize("case", list(UNKNOWN_NAMES))
def test_unknown_name_is_a_value_error_naming_it(site, tiny_llama, case):
    env, choose = UNKNOWN_NAMES[case]
    for var, value in env.items():
        site.mp.setenv(var, value)
    with pytest.raises(ValueError, match=r"unknown (platform|attention backend) 'nope'"):
        choose(tiny_llama)


def _doc_section(heading: str) -> str:
    return DOCS.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_tiny_checkpoint_recipe_in_docs_runs_and_warns_without_tokenizer(
    site, tmp_path, monkeypatch, tokenmill_log
):
    """The docs' snippets, run in order: a tiny checkpoint without a tokenizer gives token ids,
    empty text and one warning at start-up; with the byte tokenizer saved, text prompts work."""
    section = _doc_section("Trying a plugin on a tiny checkpoint")
    make, run, save_tokenizer, run_text = re.findall(r"```python\n(.*?)```", section, re.S)
    warning = re.search(r"```text\n(.*?)\n```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(make, namespace)
    exec(run, namespace)
    completion = namespace["completion"]
    assert completion.token_ids and completion.text == ""
    warnings = [msg for _, level, msg in tokenmill_log if level >= logging.WARNING]
    assert warnings == [warning]
    with pytest.raises(ValueError, match="this model has no tokenizer"):
        namespace["llm"].generate("Hello", use_tqdm=False)

    tokenmill_log.clear()
    exec(save_tokenizer, namespace)
    exec(run_text, namespace)
    assert namespace["out"][0].prompt_token_ids == [39, 68, 75, 75, 78]
    assert not [msg for _, level, msg in tokenmill_log if level >= logging.WARNING]


def test_op_table_path_that_does_not_import_names_platform_and_op():
    class BadOpsPlatform(Platform):
        name = "bad-ops"
        custom_ops = {"rms_norm": "no_such_module_for_tokenmill:rms_norm"}

    with pytest.raises(ImportError, match="platform 'bad-ops': cannot import op 'rms_norm'"):
        BadOpsPlatform.get_ops()


def test_op_table_with_an_unknown_op_name_is_refused():
    class TypoOpsPlatform(Platform):
        name = "typo-ops"
        custom_ops = {"rmsnorm": "tokenmill_example_plugin.ops:rms_norm"}

    with pytest.raises(ValueError, match="platform 'typo-ops' replaces unknown op\\(s\\) 'rmsnorm'; ops are rms_norm, residual_sum, silu_and_mul, rotary_embedding, embedding, unquantized_linear, unquantized_fused_moe"):
        TypoOpsPlatform.get_ops()
