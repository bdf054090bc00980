"""Structured outputs in the engine core (vLLM's ``StructuredOutputManager``).

Constraints are compiled by a small pool of worker threads (xgrammar releases the GIL), so
the engine loop keeps stepping while a new request's grammar compiles, and one slow constraint
does not hold back the others; the engine core holds such a request back until its matcher is
ready, and fails it if compiling takes longer than ``TOKENMILL_GRAMMAR_COMPILE_TIMEOUT``. A
compile whose request was aborted is dropped if it has not started; one already running cannot
be interrupted, but its size is bounded (``MAX_CHOICES``, ``MAX_CONSTRAINT_CHARS``) and it only
keeps its own thread busy.

Each step, one bitmask row is filled for every sampling position of a scheduled request that
samples and has a constraint (one, or ``k + 1`` with ``k`` drafts: the matcher advances through
the drafts and rolls back), and the model runner masks those positions' logits before
sampling. The emitted tokens then advance the matchers for good, a request whose constraint
terminates finishes, and new drafts are cut at the first token the constraint rejects.

xgrammar is imported only when the first constrained request arrives."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.core.request import Request
    from tokenmill.structured_output.backend_types import StructuredOutputBackend

logger = logging.getLogger(__name__)

COMPILE_THREADS = 4
"""Constraints compiled at once."""


def backend_class() -> type[StructuredOutputBackend]:
    """The structured-output backend (xgrammar)."""
    from tokenmill.structured_output.backend_xgrammar import XgrammarBackend

    return XgrammarBackend


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Raise ``ValueError`` naming the problem if the constraint does not compile."""
    backend_class().validate(params)


class StructuredOutputManager:
    """Compiles the constraints of one engine core's requests and builds each step's bitmask."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's constraint in the background."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=COMPILE_THREADS, thread_name_prefix="tokenmill-grammar"
            )
        so_request = StructuredOutputRequest(params, concurrent.futures.Future())
        self._executor.submit(self._compile, so_request)
        request.structured_output_request = so_request

    def _compile(self, so_request: StructuredOutputRequest) -> None:
        """Compile into ``so_request.future``, unless it was cancelled while queued."""
        if not so_request.future.set_running_or_notify_cancel():
            return
        try:
            backend = self._get_backend()
            so_request.compile_started = time.monotonic()
            so_request.future.set_result(backend.compile_grammar(so_request.params))
        except Exception as e:
            so_request.future.set_exception(e)

    def _get_backend(self) -> StructuredOutputBackend:
        with self._backend_lock:
            if self._backend is None:
                from tokenmill.model_loader.tokenizer import load_tokenizer

                path = self.config.tokenizer or self.config.model_path
                tokenizer = load_tokenizer(path)
                if tokenizer is None:
                    raise ValueError(f"structured outputs need a tokenizer and {path} has none")
                self._backend = backend_class()(tokenizer, self.config.hf_config.vocab_size)
            return self._backend

    def grammar_bitmask(
        self, requests: Iterable[Request], spec_tokens: dict[str, list[int]]
    ) -> tuple[list[str], np.ndarray] | None:
        """The ids of the constrained requests among ``requests`` (those that sample this
        step) and their bitmask rows, ``len(spec_tokens[id]) + 1`` per request in that order;
        None when there are none."""
        constrained = [r for r in requests if r.structured_output_request is not None]
        if not constrained:
            return None
        assert self._backend is not None
        drafts = [spec_tokens.get(r.request_id, []) for r in constrained]
        bitmask = self._backend.allocate_token_bitmask(sum(len(d) + 1 for d in drafts))
        index = 0
        for request, request_drafts in zip(constrained, drafts):
            request.structured_output_request.grammar.fill_bitmasks(bitmask, index, request_drafts)
            index += len(request_drafts) + 1
        return [r.request_id for r in constrained], bitmask.numpy()

    def validate_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """``drafts`` cut at the first token the request's constraint rejects (or completes)."""
        return request.structured_output_request.grammar.validate_tokens(drafts)

    def accept_tokens(self, request: Request, token_ids: list[int]) -> bool:
        """Advance the request's matcher; return whether its constraint has terminated."""
        grammar = request.structured_output_request.grammar
        if not grammar.accept_tokens(request.request_id, token_ids):
            logger.error(
                "request %s: the grammar rejected tokens %s it had allowed",
                request.request_id,
                token_ids,
            )
        return grammar.is_terminated()
