"""Prompt-lookup drafting: continue the sequence the way it continued the last time its recent tokens appeared.

Repetitive outputs (rewriting code, quoting the prompt, lists) make the last n tokens recur; the tokens that
followed their most recent earlier occurrence are a free, deterministic guess.
"""
from __future__ import annotations

import numpy as np

from engine.speculative.proposer import DraftRequest, Proposal


class NgramProposer:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.ngram_sizes = range(max_ngram, min_ngram - 1, -1)

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return [Proposal(self.lookup(r.token_ids, r.k)) for r in requests]

    def lookup(self, token_ids, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        if k <= 0 or len(token_ids) < 2:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in self.ngram_sizes:
            start = _last_earlier_match(tokens, n)
            if start is not None:
                return tokens[start + n:start + n + k].tolist()
        return []

    def on_accepted(self, seq_id: int, num_tokens_kept: int) -> None:
        pass

    def release(self, seq_id: int) -> None:
        pass


def _last_earlier_match(tokens: np.ndarray, n: int) -> int | None:
    """Start of the latest window tokens[i:i+n] == tokens[-n:] followed by at least one token (so not the
    suffix itself)."""
    if len(tokens) <= n:
        return None
    windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [L - n, n], last one ends at L - 2
    hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
    return int(hits[-1]) if hits.size else None
