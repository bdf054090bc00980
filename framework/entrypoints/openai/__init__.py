"""The OpenAI-compatible API server (``tokenmill serve``)."""
