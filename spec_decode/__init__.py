"""Speculative decoding: proposers (n-gram, draft model, EAGLE, MTP) and rejection sampling.

Proposers implement ``tokenmill.interfaces.Proposer`` and are registered through the
``register_proposers`` hook of a ``tokenmill.plugins`` entry point.
"""

from tokenmill.plugins import hookimpl


@hookimpl
def register_proposers(register):
    register("ngram", "tokenmill.spec_decode.ngram:NgramProposer")
    register("draft_model", "tokenmill.spec_decode.draft_model:DraftModelProposer")
    register("eagle", "tokenmill.spec_decode.eagle:EagleProposer")
    register("eagle3", "tokenmill.spec_decode.eagle:Eagle3Proposer")
    register("mtp", "tokenmill.spec_decode.eagle:MTPProposer")
