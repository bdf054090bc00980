"""The plugin conformance kit: pytest suites that check a platform, attention backend or model
against the reference (run with ``pytest --tokenmill-plugin NAME``; see ``plugin``), and the
paged batches and tiny checkpoints they are built from."""
