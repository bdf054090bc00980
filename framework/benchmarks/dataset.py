"""Random-token workloads, as vLLM's ``--dataset-name random``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def sample_lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    """Lengths uniform in ``[mean*(1-ratio), mean*(1+ratio)]`` (at least 1)."""
    low = max(1, int(mean * (1 - ratio)))
    high = max(low, int(mean * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
    special_ids: list[int] | tuple[int, ...] = (),
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = sample_lengths(rng, output_len, range_ratio, num_prompts)
    allowed = np.setdiff1d(np.arange(vocab_size), np.array(special_ids, dtype=np.int64))
    return [
        BenchRequest(rng.choice(allowed, size=int(n)).tolist(), int(m))
        for n, m in zip(in_lens, out_lens)
    ]


RANGE_RATIO_HELP = "lengths are drawn uniformly within this fraction either side of the given ones"


def add_dataset_arguments(parser) -> None:
    """vLLM's random-dataset flags; the dataset is drawn with the engine's ``--seed``."""
    parser.add_argument(
        "--dataset-name", default="random", choices=["random"], help="prompts of random token ids"
    )
    parser.add_argument("--num-prompts", type=int, default=64, help="requests to run")
    parser.add_argument(
        "--input-len",
        "--random-input-len",
        dest="input_len",
        type=int,
        default=256,
        help="prompt tokens per request",
    )
    parser.add_argument(
        "--output-len",
        "--random-output-len",
        dest="output_len",
        type=int,
        default=128,
        help="output tokens per request",
    )
    parser.add_argument("--random-range-ratio", type=float, default=0.0, help=RANGE_RATIO_HELP)
