"""NGRAM drafts: the tokens that followed the latest earlier occurrence of a request's
longest matching suffix (``--speculative-algorithm NGRAM``).

For a request whose tokens (prompt + output) are ``t[0..L)``, the suffix of ``w`` tokens
``t[L-w..L)`` is looked up for ``w`` from ``max_window`` down to ``min_window``; the first
``w`` that occurred earlier wins (the longest match), and of its occurrences the latest
(SGLang's BFS order is by recency too). The drafts are the tokens that followed it,
``t[j..j+k)``, at most ``k`` of them; where they would run past ``L`` the match's period
repeats (a suffix that recurs every ``p`` tokens is drafted as recurring again).

SGLang keeps one trie of n-grams over every request (``--speculative-ngram-capacity``,
``-branch-length``, ``-bfs-breadth``) and drafts a tree from it; this index is the
request's own, and its drafts are one chain.

``NgramIndex`` is plain Python: per window size ``w`` a dict from each ``w``-gram to the
position after its latest occurrence, filled incrementally as the request's tokens grow
(each token is indexed once; a lookup costs ``max_window`` dict probes).
"""

from __future__ import annotations


class NgramIndex:
    """The ``w``-grams (``min_window <= w <= max_window``) of one token sequence that only
    grows at its end, each mapped to the position after its latest occurrence."""

    def __init__(self, min_window: int, max_window: int) -> None:
        assert 1 <= min_window <= max_window, (min_window, max_window)
        self.min_window = min_window
        self.max_window = max_window
        self.ends: dict[int, dict[tuple[int, ...], int]] = {
            w: {} for w in range(min_window, max_window + 1)}
        self.indexed = 0  # n-grams ending before this position are in ``ends``

    def _extend(self, tokens: list[int]) -> None:
        """Index the n-grams that end at positions ``indexed .. len(tokens) - 1``: every
        one except those ending at the sequence's end (a match must be earlier)."""
        stop = len(tokens) - 1
        for end in range(max(self.indexed, self.min_window), stop + 1):
            for w in range(self.min_window, min(self.max_window, end) + 1):
                self.ends[w][tuple(tokens[end - w: end])] = end
        self.indexed = max(self.indexed, stop + 1)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` (the whole sequence so far; the
        same list, grown, at every call)."""
        if k <= 0:
            return []
        self._extend(tokens)
        n = len(tokens)
        for w in range(min(self.max_window, n - 1), self.min_window - 1, -1):
            start = self.ends[w].get(tuple(tokens[n - w:]))
            if start is not None:
                return _continuation(tokens, start, k)
        return []


def _continuation(tokens: list[int], start: int, k: int) -> list[int]:
    """``k`` tokens from ``start`` on; past the sequence's end the match's period repeats
    (the suffix recurs every ``len(tokens) - start`` tokens, so would what follows it)."""
    draft = tokens[start: start + k]
    period = len(tokens) - start
    while len(draft) < k:
        draft.append(draft[len(draft) - period])
    return draft
