"""First-party tool-call parsers, registered through the ``tokenmill.plugins`` entry point;
``tokenmill serve --tool-call-parser NAME`` picks one."""

from tokenmill.plugins import hookimpl


@hookimpl
def register_tool_parsers(register):
    register("hermes", "tokenmill.entrypoints.openai.tool_parsers.hermes:Hermes2ProToolParser")
    register(
        "llama3_json", "tokenmill.entrypoints.openai.tool_parsers.llama3_json:Llama3JsonToolParser"
    )
    register("mistral", "tokenmill.entrypoints.openai.tool_parsers.mistral:MistralToolParser")
    register("granite", "tokenmill.entrypoints.openai.tool_parsers.granite:GraniteToolParser")
    register("internlm", "tokenmill.entrypoints.openai.tool_parsers.internlm:InternLM2ToolParser")
    register("pythonic", "tokenmill.entrypoints.openai.tool_parsers.pythonic:PythonicToolParser")
    register(
        "llama4_pythonic",
        "tokenmill.entrypoints.openai.tool_parsers.pythonic:Llama4PythonicToolParser",
    )
