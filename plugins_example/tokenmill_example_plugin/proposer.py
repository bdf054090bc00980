"""``corpus-lookup``: drafts the continuation of the request's last tokens in a user-given corpus.

``speculative_config={"method": "corpus-lookup", "num_speculative_tokens": k,
"corpus_token_ids": [[...], ...], "lookup_len": 3}``: every ``lookup_len``-gram of the corpus
maps to the ``k`` tokens that follow its first occurrence; a request whose last
``lookup_len`` tokens are such an n-gram gets them as drafts.
"""

from __future__ import annotations

import numpy as np

from tokenmill.interfaces import Proposal, ProposalBatch, Proposer


class CorpusLookupProposer(Proposer):
    def __init__(self, spec, config, device) -> None:
        super().__init__(spec, config, device)
        extra = dict(spec.extra)
        unknown = sorted(set(extra) - {"corpus_token_ids", "lookup_len"})
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) for 'corpus-lookup': {', '.join(unknown)}")
        corpus = extra.get("corpus_token_ids")
        if not corpus or not all(isinstance(doc, list) for doc in corpus):
            raise ValueError("speculative_config['corpus_token_ids'] must be a list of token-id lists")
        self.n = int(extra.get("lookup_len", 3))
        if self.n < 1:
            raise ValueError(f"speculative_config['lookup_len'] must be positive, got {self.n}")
        k = spec.num_speculative_tokens
        self.table: dict[tuple[int, ...], list[int]] = {}
        for doc in corpus:
            for i in range(len(doc) - self.n):
                self.table.setdefault(tuple(doc[i : i + self.n]), doc[i + self.n : i + self.n + k])

    def propose(self, batch: ProposalBatch) -> Proposal:
        k = batch.num_speculative_tokens
        drafts = np.zeros((len(batch.rows), k), dtype=np.int64)
        counts = np.zeros(len(batch.rows), dtype=np.int64)
        ib = batch.input_batch
        for j, row in enumerate(batch.rows):
            end = ib.num_tokens[row]
            if end < self.n:
                continue
            found = self.table.get(tuple(ib.token_ids[row, end - self.n : end].tolist()), [])
            counts[j] = len(found)
            drafts[j, : len(found)] = found
        return Proposal(drafts, counts)
