"""Vectorised group statistics: one sort per call, no Python loop over groups."""

from __future__ import annotations

import numpy as np


def group_counts(groups: np.ndarray, n_groups: int) -> np.ndarray:
    return np.bincount(groups, minlength=n_groups)


def group_median(values: np.ndarray, groups: np.ndarray, n_groups: int) -> np.ndarray:
    """Median of ``values`` per group id in ``[0, n_groups)``; NaN values are ignored.

    Groups with no (non-NaN) value get NaN.
    """
    values = np.asarray(values, dtype=np.float64)
    keep = ~np.isnan(values)
    if not keep.all():
        values, groups = values[keep], groups[keep]
    out = np.full(n_groups, np.nan)
    if values.size == 0:
        return out
    order = np.lexsort((values, groups))
    v = values[order]
    counts = np.bincount(groups, minlength=n_groups)
    starts = np.cumsum(counts) - counts
    has = counts > 0
    lo = starts[has] + (counts[has] - 1) // 2
    hi = starts[has] + counts[has] // 2
    out[has] = (v[lo] + v[hi]) / 2.0
    return out


def group_mad(values: np.ndarray, groups: np.ndarray, n_groups: int, median: np.ndarray | None = None) -> np.ndarray:
    """Median absolute deviation per group (unscaled)."""
    if median is None:
        median = group_median(values, groups, n_groups)
    return group_median(np.abs(np.asarray(values, dtype=np.float64) - median[groups]), groups, n_groups)


def group_nanmean(values: np.ndarray, groups: np.ndarray, n_groups: int) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    ok = ~np.isnan(values)
    s = np.bincount(groups[ok], weights=values[ok], minlength=n_groups)
    n = np.bincount(groups[ok], minlength=n_groups)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, s / np.maximum(n, 1), np.nan)


def group_min(values: np.ndarray, groups: np.ndarray, n_groups: int) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    ok = ~np.isnan(values)
    out = np.full(n_groups, np.inf)
    np.minimum.at(out, groups[ok], values[ok])
    out[np.isinf(out)] = np.nan
    return out


def group_max(values: np.ndarray, groups: np.ndarray, n_groups: int) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    ok = ~np.isnan(values)
    out = np.full(n_groups, -np.inf)
    np.maximum.at(out, groups[ok], values[ok])
    out[np.isinf(out)] = np.nan
    return out


def group_or(values: np.ndarray, groups: np.ndarray, n_groups: int) -> np.ndarray:
    out = np.zeros(n_groups, dtype=np.uint64)
    np.bitwise_or.at(out, groups, np.asarray(values, dtype=np.uint64))
    return out


def encode_strings(values: list[str] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dictionary-encode strings: (codes int32, uniques)."""
    uniques, codes = np.unique(np.asarray(values, dtype=object), return_inverse=True)
    return codes.astype(np.int32), uniques
