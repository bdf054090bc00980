"""tokenmill's example out-of-tree plugin.

The ``tokenmill.plugins`` entry point ``example`` names this module. Its hooks register a
platform (with its own RMSNorm op), an attention backend and a model architecture by
``module:Class`` string, so nothing below is imported until an engine chooses it, a
speculative-decoding proposer (``corpus-lookup``), and the ``tokenmill example-hello`` command.
"""

from tokenmill.plugins import hookimpl


@hookimpl
def register_platforms(register):
    register("example", "tokenmill_example_plugin.platform:ExamplePlatform")


@hookimpl
def register_attention_backends(register):
    register("example-hnd", "tokenmill_example_plugin.attention:HeadMajorBackend")


@hookimpl
def register_models(register):
    register("GPT2LMHeadModel", "tokenmill_example_plugin.gpt2:GPT2LMHeadModel")


@hookimpl
def register_proposers(register):
    register("corpus-lookup", "tokenmill_example_plugin.proposer:CorpusLookupProposer")


@hookimpl
def register_commands(register):
    register("example-hello", "tokenmill_example_plugin.commands:add_hello")
