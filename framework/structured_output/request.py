"""The structured-output state of one engine-core request."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend_types import StructuredOutputGrammar


@dataclass
class StructuredOutputRequest:
    """A request's constraint and its matcher, compiled off the engine loop: until
    ``future`` is done the request waits outside the scheduler (vLLM's WAITING_FOR_FSM).
    ``compile_started``: when a worker began compiling it (monotonic), None while queued."""

    params: StructuredOutputsParams
    future: Future[StructuredOutputGrammar]
    compile_started: float | None = None

    @property
    def is_ready(self) -> bool:
        return self.future.done()

    def compiling_longer_than(self, seconds: float, now: float) -> bool:
        """Whether it has been compiling for more than ``seconds`` and is not done."""
        started = self.compile_started
        return started is not None and not self.is_ready and now - started > seconds

    @property
    def grammar(self) -> StructuredOutputGrammar:
        """The matcher; raises the compilation's exception if it failed."""
        return self.future.result()
