import numpy as np
import pytest
import torch

from tokenmill.sample.sampler import Sampler, SamplingMetadata, position_seed, processed_logits, to_probs

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
NUM_DRAWS = 50_000


def make_metadata(
    temperature: list[float],
    top_p: list[float] | None = None,
    top_k: list[int] | None = None,
    min_p: list[float] | None = None,
    seeds: dict[int, int] | None = None,
    max_num_logprobs: int | None = None,
    suppress_token_ids: dict[int, list[int]] | None = None,
) -> SamplingMetadata:
    t = torch.tensor(temperature, dtype=torch.float32)
    greedy = t < 1e-5
    return SamplingMetadata(
        temperature=t,
        all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int64),
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        seeds=seeds or {},
        max_num_logprobs=max_num_logprobs,
        suppress_token_ids=suppress_token_ids or {},
    )


def expected_distribution(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """Reference in numpy: temperature, then min-p, then top-k, then top-p."""
    p = np.exp(LOGITS / temperature - (LOGITS / temperature).max())
    p /= p.sum()
    p = np.where(p >= min_p * p.max(), p, 0.0)
    if top_k:
        p[np.argsort(-p)[top_k:]] = 0.0
    p /= p.sum()
    order = np.argsort(-p)
    num_kept = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1
    p[order[num_kept:]] = 0.0
    return p / p.sum()


def empirical_distribution(**params) -> np.ndarray:
    torch.manual_seed(0)
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(NUM_DRAWS, -1).contiguous()
    metadata = make_metadata(
        [params.get("temperature", 1.0)] * NUM_DRAWS,
        top_p=[params["top_p"]] * NUM_DRAWS if "top_p" in params else None,
        top_k=[params["top_k"]] * NUM_DRAWS if "top_k" in params else None,
        min_p=[params["min_p"]] * NUM_DRAWS if "min_p" in params else None,
    )
    sampled = Sampler()(logits, metadata).sampled_token_ids
    return np.bincount(sampled.numpy(), minlength=len(LOGITS)) / NUM_DRAWS


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.7},
        {"top_k": 3},
        {"top_p": 0.85},
        {"min_p": 0.1},
        {"min_p": 0.2, "top_p": 0.85},
        {"temperature": 0.8, "min_p": 0.03, "top_k": 5, "top_p": 0.8},
    ],
    ids=str,
)
def test_empirical_distribution_matches(params):
    expected = expected_distribution(**params)
    observed = empirical_distribution(**params)
    assert np.abs(observed - expected).max() < 0.01
    assert (observed[expected == 0] == 0).all()


def test_greedy_is_argmax():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    out = Sampler()(logits, make_metadata([0.0] * 6))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.logprob_token_ids is None


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(2))
    metadata = make_metadata([0.0, 1.0, 0.0, 1.5, 0.0, 0.5], top_k=[100, 5, 100, 100, 100, 2])
    for _ in range(20):
        sampled = Sampler()(logits, metadata).sampled_token_ids
        assert torch.equal(sampled[::2], logits[::2].argmax(-1))
    probs = to_probs(processed_logits(logits, metadata), logits, metadata)
    assert torch.equal(probs[::2], torch.nn.functional.one_hot(logits[::2].argmax(-1), 100).float())
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))


def _seeded_samples(logits: torch.Tensor, metadata_for_step, seed_rows: dict[int, int], steps: int):
    sampler = Sampler()
    steps_out = [
        sampler(logits, metadata_for_step({row: position_seed(seed, t) for row, seed in seed_rows.items()}))
        .sampled_token_ids
        for t in range(steps)
    ]
    return torch.stack(steps_out)


def test_seeded_row_does_not_depend_on_its_batch():
    vocab = 1000
    row_logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    steps = 20

    alone = _seeded_samples(
        row_logits[None],
        lambda g: make_metadata([0.9], top_p=[0.95], seeds=g),
        {0: 1234},
        steps,
    )[:, 0]
    assert len(set(alone.tolist())) > 5

    others = torch.randn(4, vocab, generator=torch.Generator().manual_seed(4))
    for position in range(5):
        batch_logits = torch.cat([others[:position], row_logits[None], others[position:]])
        temps = [1.0, 1.0, 0.0, 0.7]
        temps.insert(position, 0.9)
        top_p = [1.0, 0.5, 1.0, 1.0]
        top_p.insert(position, 0.95)
        other_seeded = 0 if position != 0 else 1
        torch.manual_seed(position)
        in_batch = _seeded_samples(
            batch_logits,
            lambda g, temps=temps, top_p=top_p: make_metadata(temps, top_p=top_p, seeds=g),
            {position: 1234, other_seeded: 99},
            steps,
        )[:, position]
        assert torch.equal(in_batch, alone), position


def test_logprobs_are_raw_with_sampled_token_first_then_top_n_sorted():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    out = Sampler()(logits, make_metadata([0.0, 0.5, 2.0], top_k=[50, 3, 50], max_num_logprobs=4))
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprob_token_ids.shape == (3, 5) and out.logprobs.shape == (3, 5)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(out.logprobs[:, 0], reference.gather(1, out.sampled_token_ids[:, None])[:, 0])
    expected_top = np.argsort(-reference.numpy(), axis=-1)[:, :4]
    assert (out.logprob_token_ids[:, 1:].numpy() == expected_top).all()
    torch.testing.assert_close(out.logprobs[:, 1:], reference.gather(1, out.logprob_token_ids[:, 1:]))
    assert (out.logprobs[:, 1:].diff(dim=-1) <= 0).all()


def test_zero_logprobs_returns_only_the_sampled_token():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(6))
    out = Sampler()(logits, make_metadata([1.0, 1.0], max_num_logprobs=0))
    assert torch.equal(out.logprob_token_ids, out.sampled_token_ids[:, None])
    torch.testing.assert_close(
        out.logprobs, torch.log_softmax(logits, -1).gather(1, out.sampled_token_ids[:, None])
    )


def test_suppressed_tokens_are_never_sampled():
    logits = torch.zeros(1000, 10)
    logits[:, 3] = 10.0
    logits[:, 7] = 9.0
    rows = [0.0] * 500 + [1.0] * 500
    suppress = {row: [3, 7, 10_000] for row in range(1000)}
    torch.manual_seed(0)
    metadata = make_metadata(rows, max_num_logprobs=2, suppress_token_ids=suppress)
    out = Sampler("processed_logprobs")(logits, metadata)
    sampled = out.sampled_token_ids
    assert not ((sampled == 3) | (sampled == 7)).any()
    assert len(set(sampled[500:].tolist())) > 4
    assert not torch.isin(out.logprob_token_ids[:, 1:], torch.tensor([3, 7])).any()
    raw = Sampler()(logits, metadata)
    assert (raw.logprob_token_ids[:, 1:] == torch.tensor([3, 7])).all()
    assert logits[0, 3] == 10.0, "the caller's logits are not modified"


def test_sampled_token_rank_counts_the_tokens_at_least_as_likely():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, 1.0], [5.0, 0.0, 0.0, 0.0, 0.0]])
    metadata = make_metadata([0.0, 0.0], max_num_logprobs=1)
    metadata.disallowed_mask = torch.tensor([[False, True, False, True, True], [False] * 5])
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids.tolist() == [2, 0]
    assert out.sampled_token_ranks.tolist() == [4, 1]
    assert out.logprob_token_ids[:, 1].tolist() == [1, 0]


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logits", "processed_logprobs"])
def test_logprobs_modes(mode):
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(7))
    metadata = make_metadata([0.0, 0.5], top_k=[30, 4], max_num_logprobs=3)
    metadata.logit_bias = (torch.tensor([0, 1]), torch.tensor([5, 5]), torch.tensor([9.0, 9.0]))
    out = Sampler(mode)(logits, metadata)
    biased = logits.clone()
    biased[:, 5] += 9.0
    scaled = biased[1] / 0.5
    scaled[scaled < scaled.topk(4).values[-1]] = float("-inf")
    processed = torch.stack([biased[0], scaled])
    expected = {
        "raw_logits": logits,
        "processed_logits": processed,
        "processed_logprobs": processed.log_softmax(-1),
    }[mode]
    torch.testing.assert_close(out.logprobs, expected.gather(1, out.logprob_token_ids))
    assert out.logprob_token_ids[:, 1].tolist() == expected.argmax(-1).tolist()


def test_unknown_logprobs_mode_is_refused():
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler("logprobs")
