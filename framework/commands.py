"""First-party ``tokenmill`` subcommands beyond the core ones in ``tokenmill.cli``, registered
through the ``tokenmill.plugins`` entry point like a plugin's."""

from tokenmill.plugins import hookimpl


@hookimpl
def register_commands(register):
    register("bench", "tokenmill.benchmarks:register_subcommand")
    register("serve", "tokenmill.entrypoints.serve:register_subcommand")
    register("router", "tokenmill.entrypoints.router:register_subcommand")
