"""First-party tool-call parsers, registered through the ``tokenmill.plugins`` entry point;
``tokenmill serve --tool-call-parser NAME`` picks one."""

from tokenmill.plugins import hookimpl


@hookimpl
def register_tool_parsers(register):
    register("hermes", "tokenmill.entrypoints.openai.tool_parsers.hermes:Hermes2ProToolParser")
    register(
        "llama3_json", "tokenmill.entrypoints.openai.tool_parsers.llama3_json:Llama3JsonToolParser"
    )
