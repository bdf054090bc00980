"""Token sampling: the batched ``Sampler`` and the probability computation it shares with
speculative decoding's rejection sampler."""
