"""Percentiles and medians over repeated runs (pure: no I/O, no clock)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by the nearest-rank method; NaN when empty."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def median(values: Sequence[float]) -> float:
    """The median of finite values; NaN when there are none."""
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def ratio(numerator: float, denominator: float) -> float:
    if not denominator or not math.isfinite(numerator) or not math.isfinite(denominator):
        return math.nan
    return numerator / denominator


def paired_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median of per-repeat ratios: each repeat measured both sides back to back,
    so the noise of that moment is in both and cancels out of the ratio."""
    return median([ratio(n, d) for n, d in zip(numerators, denominators, strict=True)])
