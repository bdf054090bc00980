"""Speculative decoding: proposers (n-gram, draft model, EAGLE, MTP) and rejection sampling.

Proposers implement ``tokenmill.interfaces.Proposer`` and are registered through the
``register_proposers`` hook of a ``tokenmill.plugins`` entry point.
"""
