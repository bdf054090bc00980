"""The offline entry point: ``LLM(...).generate(prompts)`` and ``.chat(messages)``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine, PromptType
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

Message = dict[str, str]
SPEED_REFRESH_S = 0.5
"""How often the progress bar's output-speed estimate is refreshed."""


class LLM:
    """An engine for offline batch generation. Keyword arguments are the engine arguments of
    ``tokenmill.engine_args.EngineArgs`` (``model=None`` is the embedded SmolLM2-135M-Instruct)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in prompt order.

        ``priority`` (one per prompt, lower first) matters with ``scheduling_policy="priority"``.
        A prompt dict may carry a ``cache_salt``: only prompts with equal salts share
        prefix-cache blocks, which keeps tenants of one engine apart.
        ``lora_request`` (with ``enable_lora``) is the adapter of every prompt, or a list
        with one adapter (or None: the base model) per prompt.
        Invalid prompts or parameters raise ``ValueError`` (``TypeError`` for a
        ``sampling_params`` of the wrong type) before anything runs."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        expected = "sampling_params must be a SamplingParams or a list of them"
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        elif not isinstance(sampling_params, Sequence) or isinstance(sampling_params, str):
            raise TypeError(f"{expected}, got {type(sampling_params).__name__}")
        else:
            params_list = list(sampling_params)
            for params in params_list:
                if not isinstance(params, SamplingParams):
                    raise TypeError(
                        f"{expected}, got a {type(sampling_params).__name__} holding a "
                        f"{type(params).__name__}"
                    )
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts"
                )
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        engine = self.llm_engine
        requests = [
            engine.input_processor.process(
                engine.next_request_id(), prompt, params, priority=prio, lora_request=lora
            )
            for prompt, params, prio, lora in zip(prompts, params_list, priorities, loras)
        ]
        for request in requests:
            engine.add_processed_request(request)
        ids = [r.request_id for r in requests]
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them and generate."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conversation in conversations:
            ids = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tokenize=True,
                return_dict=False,
            )
            text = tokenizer.decode(ids)
            prompts.append({"prompt": text, "prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_stats(self) -> dict[str, int]:
        return self.llm_engine.get_stats()

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        generated_before = engine.output_processor.num_generated_tokens
        shown = time.monotonic()
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
                if use_tqdm and time.monotonic() - shown >= SPEED_REFRESH_S:
                    shown = time.monotonic()
                    generated = engine.output_processor.num_generated_tokens - generated_before
                    speed = generated / bar.format_dict["elapsed"]
                    bar.set_postfix_str(f"est. speed output: {speed:.1f} toks/s")
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]
