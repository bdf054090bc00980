"""First-party attention backends, registered through the ``tokenmill.plugins`` entry point."""

from tokenmill.plugins import hookimpl


@hookimpl
def register_attention_backends(register):
    register("torch", "tokenmill.attention_backends.torch_ref:TorchRefBackend")
