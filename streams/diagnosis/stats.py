"""Vectorised group statistics: one sort per call, no Python loop over groups or workers.

Two shapes of data:

- flat values with a group id each (``group_median`` and friends): one lexsort;
- a (workers x columns) matrix whose workers belong to peer groups
  (:class:`Layout`): the workers are laid out as a padded (groups x width x
  columns) cube so that a median per (group, column) is one ``np.sort`` along
  one axis.  This is several times faster than a lexsort for the step stage's
  10,000 x 20 matrices; very unequal group sizes fall back to the flat path.
"""

from __future__ import annotations

import numpy as np


def group_median(values: np.ndarray, groups: np.ndarray, n_groups: int, upper: bool = False) -> np.ndarray:
    """Median of ``values`` per group id in ``[0, n_groups)``; NaN values are ignored.

    Groups with no (non-NaN) value get NaN.  ``upper``: the upper median (of an even count, the larger of the two
    middle values; of two values, the larger).
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
    out[has] = v[hi] if upper else (v[lo] + v[hi]) / 2.0
    return out


def others_median(values: np.ndarray, groups: np.ndarray, n_groups: int, include: np.ndarray) -> np.ndarray:
    """Per row: the median of ``values`` over the *other* rows of its group id that ``include`` marks (the row itself
    left out; NaN values ignored; NaN where no other is included).  One lexsort."""
    v = np.asarray(values, dtype=np.float64)
    inc = np.asarray(include, dtype=bool) & ~np.isnan(v)
    rows = np.flatnonzero(inc)
    out = np.full(v.size, np.nan)
    if rows.size == 0:
        return out
    order = rows[np.lexsort((v[rows], groups[rows]))]
    sv = v[order]
    counts = np.bincount(groups[rows], minlength=n_groups)
    starts = np.cumsum(counts) - counts
    pos = np.full(v.size, -1, dtype=np.int64)  # each included row's place among its group's included, sorted
    pos[order] = np.arange(order.size) - starts[groups[order]]
    others = counts[groups] - inc  # how many others each row has
    one = inc.astype(np.int64)

    def at(k: np.ndarray) -> np.ndarray:  # the k-th of the others, sorted: past the row itself, one further
        picked: np.ndarray = sv[np.clip(starts[groups] + k + one * (k >= pos), 0, sv.size - 1)]
        return picked

    has = others >= 1
    out[has] = ((at((others - 1) // 2) + at(others // 2)) / 2.0)[has]
    return out


def group_or(values: np.ndarray, groups: np.ndarray, n_groups: int) -> np.ndarray:
    out = np.zeros(n_groups, dtype=np.uint64)
    np.bitwise_or.at(out, groups, np.asarray(values, dtype=np.uint64))
    return out


def majority_bits(values: np.ndarray, groups: np.ndarray, n_groups: int, bits: int = 16) -> np.ndarray:
    """Per group, the bits set on at least half of the rows (NVML clock-event reasons use the low bits)."""
    values = np.asarray(values, dtype=np.uint64)
    out = np.zeros(n_groups, dtype=np.uint64)
    if not values.any():
        return out
    n = np.bincount(groups, minlength=n_groups)
    for bit in range(bits):
        has = ((values >> np.uint64(bit)) & np.uint64(1)).astype(np.int64)
        k = np.bincount(groups, weights=has, minlength=n_groups)
        out |= np.where((n > 0) & (2 * k >= n), np.uint64(1 << bit), np.uint64(0))
    return out


def others_extremes(groups: np.ndarray, n_groups: int, m: np.ndarray, max_size: int) -> tuple[np.ndarray, np.ndarray]:
    """For workers of groups of 2 to ``max_size`` workers: per column, the largest and the smallest value of the
    *other* workers of the worker's group (NaN values ignored); NaN for workers of other groups.  ``m`` is
    (workers x columns)."""
    groups = np.asarray(groups, dtype=np.intp)
    counts = np.bincount(groups, minlength=n_groups)
    sel = ((counts >= 2) & (counts <= max_size))[groups]
    out = (np.full(m.shape, np.nan), np.full(m.shape, np.nan))
    if not sel.any():
        return out
    ids, sub = np.unique(groups[sel], return_inverse=True)
    lay = Layout(sub, ids.size)
    cube = lay.cube(m[sel], lay.width)  # (groups, width, columns), NaN-padded
    mine = m[sel]
    for i, (fill, first) in enumerate(((-np.inf, -1), (np.inf, 0))):  # the largest, then the smallest
        s = np.sort(np.nan_to_num(cube, nan=fill), axis=1)
        top, second = s[:, first, :][sub], s[:, first - 1 if first else 1, :][sub]
        other = np.where(mine == top, second, top)
        out[i][sel] = np.where(np.isfinite(other), other, np.nan)
    return out


class Layout:
    """Workers of one step grouped by peer group, for statistics of (workers x columns) matrices.

    ``groups`` holds each worker's group id in ``[0, n_groups)``; every group has
    at least one worker.
    """

    def __init__(self, groups: np.ndarray, n_groups: int):
        groups = np.asarray(groups, dtype=np.intp)
        n = groups.size
        self.groups = groups
        self.n_groups = n_groups
        self.counts = np.bincount(groups, minlength=n_groups)
        self.order = np.argsort(groups, kind="stable")
        self.starts = np.cumsum(self.counts) - self.counts
        self.pos = np.empty(n, dtype=np.intp)
        self.pos[self.order] = np.arange(n) - self.starts[groups[self.order]]
        self.width = int(self.counts.max()) if n else 0

    def _cube_ok(self, width: int) -> bool:
        return self.n_groups * width <= 4 * self.groups.size + 1024

    def cube(self, m: np.ndarray, width: int) -> np.ndarray:
        """(groups x width x columns), NaN-padded; workers past ``width`` in their group are left out."""
        out = np.full((self.n_groups, width, m.shape[1]), np.nan)
        keep = self.pos < width
        out[self.groups[keep], self.pos[keep]] = m[keep]
        return out

    def median(self, m: np.ndarray, sample: int | None = None) -> np.ndarray:
        """Median per (group, column) of a (workers x columns) float matrix, ignoring NaN.

        ``sample``: use at most the first ``sample`` workers of each group (an
        estimate for big groups at a fraction of the cost).
        """
        m = np.asarray(m, dtype=np.float64)
        width = self.width if sample is None else min(sample, self.width)
        if m.shape[1] == 0 or width == 0:
            return np.full((self.n_groups, m.shape[1]), np.nan)
        if not self._cube_ok(width):
            keep = self.pos < width
            cols = m.shape[1]
            cell = (self.groups[keep, None] * cols + np.arange(cols)[None, :]).ravel()
            return group_median(m[keep].ravel(), cell, self.n_groups * cols).reshape(self.n_groups, cols)
        c = np.sort(self.cube(m, width), axis=1)  # NaN sorts last
        return self._sorted_median(c, np.sum(~np.isnan(c), axis=1))

    def median_rest(self, m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`median`, and the median and MAD per (group, column) of its values but the highest (NaN where that
        leaves none): one sort for both medians."""
        m = np.asarray(m, dtype=np.float64)
        if m.shape[1] == 0 or self.width == 0 or not self._cube_ok(self.width):
            top = -self.min(-m)
            with np.errstate(invalid="ignore"):
                rest = np.where(m >= top[self.groups], np.nan, m)  # ties with the highest left out too
            rest_med = self.median(rest)
            return self.median(m), rest_med, self.mad(rest, rest_med)
        c = np.sort(self.cube(m, self.width), axis=1)  # NaN sorts last
        k = np.sum(~np.isnan(c), axis=1)  # (groups, columns)
        med, rest = self._sorted_median(c, k), self._sorted_median(c, k - 1)  # the highest sorts last of them
        dev = np.where(np.arange(self.width)[None, :, None] < (k - 1)[:, None, :], np.abs(c - rest[:, None, :]), np.nan)
        return med, rest, self._sorted_median(np.sort(dev, axis=1), k - 1)

    def _sorted_median(self, c: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Per (group, column) the median of the first ``k`` values of a cube sorted along its workers."""
        lo = np.maximum((k - 1) // 2, 0)[:, None, :]
        hi = np.minimum(np.maximum(k // 2, 0), c.shape[1] - 1)[:, None, :]
        med = (np.take_along_axis(c, lo, axis=1) + np.take_along_axis(c, hi, axis=1))[:, 0, :] / 2.0
        return np.where(k > 0, med, np.nan)

    def mad(self, m: np.ndarray, median: np.ndarray) -> np.ndarray:
        """Median absolute deviation per (group, column) (unscaled)."""
        return self.median(np.abs(m - median[self.groups]))

    def sum(self, m: np.ndarray) -> np.ndarray:
        """Sum per (group, column); NaN counts as 0."""
        m = np.nan_to_num(np.asarray(m, dtype=np.float64))
        if m.shape[0] == 0:
            return np.zeros((self.n_groups, m.shape[1]))
        return np.add.reduceat(m[self.order], self.starts, axis=0)

    def min(self, m: np.ndarray) -> np.ndarray:
        """Minimum per (group, column), ignoring NaN (NaN where a group has none)."""
        m = np.asarray(m, dtype=np.float64)
        if m.shape[0] == 0:
            return np.full((self.n_groups, m.shape[1]), np.nan)
        return np.fmin.reduceat(m[self.order], self.starts, axis=0)
