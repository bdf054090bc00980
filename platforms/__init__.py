"""First-party platforms, registered through the ``tokenmill.plugins`` entry point."""

from tokenmill.plugins import hookimpl


@hookimpl
def register_platforms(register):
    register("cpu", "tokenmill.platforms.cpu:CpuPlatform")
    register("cuda", "tokenmill.platforms.cuda:CudaPlatform")
    register("rocm", "tokenmill.platforms.rocm:RocmPlatform")
