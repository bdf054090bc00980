"""First-party platforms, registered through the ``tokenmill.plugins`` entry point."""

from tokenmill.plugins import hookimpl


@hookimpl
def register_platforms(register):
    register("cpu", "tokenmill.platforms.cpu:CpuPlatform")
