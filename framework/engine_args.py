"""The engine arguments a user sets (``LLM(...)`` keywords, the CLI's engine flags), each with
its help text. Kept free of torch so that the ``tokenmill`` command parses and fails fast;
``EngineConfig`` (``tokenmill.config``) adds the checks and the derived fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from tokenmill.envs import ENVIRONMENT_VARIABLES

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
MAX_DEFAULT_MODEL_LEN = 32768
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

DistributedExecutorBackend = Literal["uni", "mp", "ray"]

DataParallelBackend = Literal["mp", "ray"]
DATA_PARALLEL_BACKENDS: tuple[str, ...] = get_args(DataParallelBackend)

All2AllBackendName = Literal["naive", "all_to_all"]
ALL2ALL_BACKEND_NAMES: tuple[str, ...] = get_args(All2AllBackendName)

PrefixCachingHashAlgo = Literal["sha256", "builtin"]
HASH_ALGOS: tuple[str, ...] = get_args(PrefixCachingHashAlgo)

LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
"""What sample ``logprobs`` report (vLLM's ``logprobs_mode``): ``raw_*`` (the default,
``raw_logprobs``) from the model's logits before any logits processing; ``processed_*`` after
``allowed_token_ids``, ``min_tokens``, ``logit_bias`` and the penalties, and for random rows
after temperature, min-p, top-k and top-p (masked tokens ``-inf``); ``*_logits`` report the
logits themselves instead of their ``log_softmax``. Prompt logprobs are always raw logprobs."""
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)


def _arg(default: Any, help: str, **cli: Any) -> Any:
    """A field with its help text; ``cli`` holds extra flag names (``flags=("-tp",)``)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineArgs:
    """The user's engine arguments, as vLLM names them; ``metadata["help"]`` describes each."""

    model: str | None = _arg(
        None, "HF-format model directory or GGUF file; None: the embedded SmolLM2-135M-Instruct"
    )
    tokenizer: str | None = _arg(None, "tokenizer directory; None: the model's")
    dtype: str = _arg(
        "auto",
        "dtype of weights and activations: auto (the platform's choice for the checkpoint's "
        "dtype) or a name such as float32, bfloat16, float16",
    )
    max_model_len: int | None = _arg(
        None,
        f"most tokens of prompt and output together; None: the model's maximum, at most "
        f"{MAX_DEFAULT_MODEL_LEN}",
    )
    max_num_seqs: int = _arg(256, "most requests in one engine step")
    max_num_batched_tokens: int | None = _arg(
        None,
        f"token budget of one engine step; None: {DEFAULT_MAX_NUM_BATCHED_TOKENS} (at least "
        f"max_model_len without chunked prefill)",
    )
    long_prefill_token_threshold: int = _arg(
        0, "most prompt tokens one request prefills in a step (chunked prefill); 0: no limit"
    )
    block_size: int = _arg(16, "tokens per KV-cache block")
    num_kv_blocks: int | None = _arg(
        None, "KV-cache blocks; None: as many as kv_cache_memory_bytes holds"
    )
    kv_cache_memory_bytes: int | None = _arg(
        None,
        f"KV-cache size in bytes; None: the platform's budget (CPU: $TOKENMILL_CPU_KVCACHE_SPACE "
        f"GiB, default {ENVIRONMENT_VARIABLES['TOKENMILL_CPU_KVCACHE_SPACE'].default:g}, at most "
        f"a quarter of available memory; GPU: from gpu_memory_utilization)",
    )
    enable_prefix_caching: bool = _arg(True, "share KV blocks between prompts with equal prefixes")
    prefix_caching_hash_algo: PrefixCachingHashAlgo = _arg(
        "sha256", "block hash: sha256 (collision-resistant) or builtin (faster, single tenant only)"
    )
    enable_chunked_prefill: bool = _arg(True, "split long prompts across engine steps")
    attention_backend: str | None = _arg(
        None,
        "attention backend (see 'tokenmill plugins'); None: $TOKENMILL_ATTENTION_BACKEND, else "
        "the best available",
    )
    platform: str | None = _arg(
        None, "platform (see 'tokenmill plugins'); None: $TOKENMILL_PLATFORM, else detected"
    )
    quantization: str | None = _arg(
        None, "quantization method (see `tokenmill plugins`); None: the checkpoint's, if any (gguf for a GGUF file)"
    )
    kv_cache_dtype: str = _arg(
        "auto",
        "KV-cache dtype: auto (the model's), fp8 or fp8_e4m3 (float8 e4m3), fp8_e5m2: one byte "
        "per value, scaled per layer",
    )
    calculate_kv_scales: bool = _arg(
        False,
        "with an FP8 KV cache, set each layer's k_scale / v_scale from the first step's keys and "
        "values (their largest magnitude over 200 and over 100, as vLLM) instead of the "
        "checkpoint's or 1.0",
    )
    speculative_config: dict[str, Any] | None = _arg(
        None,
        "speculative decoding, as a JSON object with vLLM's keys: method (ngram, draft_model, "
        "eagle, eagle3, mtp or a plugin's), num_speculative_tokens, model, prompt_lookup_min, "
        "prompt_lookup_max (ngram's; with a method that runs a model, drafts from the lookup "
        "where it matches), disable_by_batch_size; and tokenmill's adaptive_draft_length (default "
        "true for the methods that run a model: each request's draft length follows its "
        "acceptance and the measured cost of drafts; false: always num_speculative_tokens)",
    )
    kv_transfer_config: dict[str, Any] | None = _arg(
        None,
        "KV connector, as a JSON object with vLLM's keys: kv_connector (storage, offload or a "
        "plugin's), kv_role (kv_producer, kv_consumer or kv_both), kv_connector_extra_config "
        "(the connector's own settings); LLM(...) also takes a KVTransferConfig",
    )
    tensor_parallel_size: int = _arg(
        1,
        "tensor-parallel ranks: each holds a slice of every layer's heads and MLP, one worker "
        "process (or Ray actor) per rank",
        flags=("-tp",),
    )
    pipeline_parallel_size: int = _arg(
        1,
        "pipeline stages: each holds a contiguous run of the decoder layers (the first the "
        "embedding, the last the norm and LM head) on tensor_parallel_size worker processes, "
        "and the engine keeps this many batches in flight so the stages work at once",
        flags=("-pp",),
    )
    enable_expert_parallel: bool = _arg(
        False,
        "shard each MoE layer's routed experts over the tensor-parallel ranks of a stage (each "
        "holds num_experts / tensor_parallel_size whole experts) instead of slicing every "
        "expert; tokens go to their experts' ranks and back through all2all_backend. With "
        "data_parallel_size > 1 the experts span every engine core's ranks (DP attention + EP "
        "MoE: num_experts / (tensor_parallel_size * data_parallel_size) each) and the cores "
        "step together, an idle one running dummy steps",
    )
    all2all_backend: All2AllBackendName = _arg(
        "naive",
        "how expert parallelism moves tokens: naive (all-gather the tokens, reduce-scatter the "
        "outputs) or all_to_all (each token only to its experts' ranks and back)",
    )
    data_parallel_size: int = _arg(
        1,
        "data-parallel engine cores behind one front end (AsyncLLM, 'tokenmill serve'), each "
        "with its own executor and KV cache; requests go to the least loaded",
        flags=("-dp",),
    )
    data_parallel_backend: DataParallelBackend = _arg(
        "mp",
        "how the front end runs its engine cores: mp (a process each, on this machine) or ray "
        "(a Ray actor each, placed with its workers on any node of a Ray cluster)",
    )
    distributed_executor_backend: DistributedExecutorBackend | None = _arg(
        None,
        "how the engine runs its workers: uni (one worker in the engine process), mp (a "
        "process per tensor-parallel rank) or ray (Ray actors, across machines); None: uni, "
        "or mp above one rank",
    )
    seed: int = _arg(0, "seed of the engine's random generator")
    scheduling_policy: str = _arg(
        "fcfs", "fcfs (arrival order) or priority (lower priority value first, then arrival)"
    )
    watermark: float = _arg(
        0.01, "fraction of KV blocks kept free when admitting new requests, in [0, 1)"
    )
    enforce_eager: bool = _arg(False, "run every step eagerly: no decode graphs (CUDA graphs, CPU graphs)")
    logprobs_mode: LogprobsMode = _arg(
        "raw_logprobs",
        "what sample logprobs report: raw_logprobs (of the model's logits, before penalties, "
        "bias and temperature), processed_logprobs (of the logits sampling draws from), "
        "raw_logits or processed_logits",
    )
    enable_lora: bool = _arg(
        False,
        "serve LoRA adapters (PEFT checkpoints) over the base model, several per batch; "
        "requests name theirs with a LoRARequest",
    )
    max_loras: int = _arg(1, "with enable_lora: most distinct adapters in one engine step (slots)")
    max_lora_rank: int = _arg(16, "with enable_lora: the highest adapter rank (r) accepted")
    max_cpu_loras: int | None = _arg(
        None, "with enable_lora: adapters kept read in host memory (LRU); None: max_loras"
    )
    gpu_memory_utilization: float | None = _arg(
        None,
        f"fraction of GPU memory for the engine; None: {DEFAULT_GPU_MEMORY_UTILIZATION} on GPUs "
        f"(refused on a CPU platform)",
    )
