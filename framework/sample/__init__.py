"""Token sampling: the one ``Sampler`` every step samples through (``sampler.py``) and the rule
it verifies draft tokens with (``rejection_sampler.py``)."""
