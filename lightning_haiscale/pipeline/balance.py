"""Balancing a run of layers over pipeline stages: the contiguous cut that minimizes the heaviest stage."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balanced_counts"]


def balanced_counts(weights: Sequence[float], parts: int) -> list[int]:
    """Contiguous cut of ``weights`` into ``parts`` non-empty runs minimizing the heaviest run (exact DP)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the lightest heaviest-run over cuts of the first i layers into k runs; cut[k][i]: last cut.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    counts, i = [], n
    for k in range(parts, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]
