"""The structured-output state of one engine-core request."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend_types import StructuredOutputGrammar


@dataclass
class StructuredOutputRequest:
    """A request's constraint and its matcher, compiled off the engine loop: until
    ``future`` is done the request waits outside the scheduler (vLLM's WAITING_FOR_FSM)."""

    params: StructuredOutputsParams
    future: Future[StructuredOutputGrammar]

    @property
    def is_ready(self) -> bool:
        return self.future.done()

    @property
    def grammar(self) -> StructuredOutputGrammar:
        """The matcher; raises the compilation's exception if it failed."""
        return self.future.result()
