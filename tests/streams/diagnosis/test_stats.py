"""Vectorised group statistics against numpy, group by group."""

from __future__ import annotations

import numpy as np
import pytest

from lockstep.streams.diagnosis.stats import Layout, group_median, others_median


def test_layout_median_and_mad_match_numpy():
    rng = np.random.default_rng(4)
    for sizes in (
        [5, 5, 5],
        [1, 7, 3, 12],
        [100, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
    ):  # the last falls back to lexsort
        groups = np.repeat(np.arange(len(sizes)), sizes)
        rng.shuffle(groups)
        m = rng.normal(size=(groups.size, 3))
        m[rng.random(m.shape) < 0.1] = np.nan
        lay = Layout(groups, len(sizes))
        med = lay.median(m)
        for g in range(len(sizes)):
            for c in range(3):
                x = m[groups == g, c]
                want = np.nanmedian(x) if np.any(~np.isnan(x)) else np.nan
                assert med[g, c] == pytest.approx(want, nan_ok=True)
                assert lay.mad(m, med)[g, c] == pytest.approx(
                    np.nanmedian(np.abs(x - want)) if np.any(~np.isnan(x)) else np.nan, nan_ok=True
                )
        assert np.allclose(
            lay.sum(np.nan_to_num(m)), [np.nan_to_num(m[groups == g]).sum(axis=0) for g in range(len(sizes))]
        )
    assert group_median(np.array([3.0, 1.0, np.nan, 2.0]), np.array([0, 0, 0, 1]), 3).tolist()[:2] == [2.0, 2.0]


def test_layout_median_rest_leaves_the_highest_out():
    rng = np.random.default_rng(5)
    for sizes in ([5, 5, 5], [1, 7, 3, 12, 2], [100, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]):  # the last: lexsort
        groups = np.repeat(np.arange(len(sizes)), sizes)
        rng.shuffle(groups)
        m = rng.normal(size=(groups.size, 3))
        m[rng.random(m.shape) < 0.1] = np.nan
        lay = Layout(groups, len(sizes))
        med, rest, rest_mad = lay.median_rest(m)
        assert np.allclose(med, lay.median(m), equal_nan=True)
        for g in range(len(sizes)):
            for c in range(3):
                x = np.sort(m[groups == g, c][~np.isnan(m[groups == g, c])])[:-1]  # all but the highest
                want = np.median(x) if x.size else np.nan
                assert rest[g, c] == pytest.approx(want, nan_ok=True)
                assert rest_mad[g, c] == pytest.approx(np.median(np.abs(x - want)) if x.size else np.nan, nan_ok=True)


def test_others_median_leaves_the_row_and_the_excluded_out():
    """Against a plain loop: the median of the other included rows of the same group, NaN values ignored."""
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 30))
        g = rng.integers(0, 4, n)
        v = rng.normal(size=n)
        v[rng.random(n) < 0.1] = np.nan
        include = rng.random(n) < 0.7
        got = others_median(v, g, 4, include)
        for i in range(n):
            others = [v[j] for j in range(n) if j != i and g[j] == g[i] and include[j] and not np.isnan(v[j])]
            if others:
                assert got[i] == pytest.approx(np.median(others))
            else:
                assert np.isnan(got[i])


def test_others_median_of_a_group_with_two_slow_rows():
    # two of four rows high: each slow row's others' median is the other slow row's or a healthy one's; with the slow
    # rows left out, every row's baseline is the healthy rows' alone
    v = np.array([10.0, 13.0, 10.5, 13.2])
    g = np.zeros(4, dtype=np.int64)
    assert others_median(v, g, 1, np.ones(4, bool)).tolist() == [13.0, 10.5, 13.0, 10.5]
    assert others_median(v, g, 1, np.array([True, False, True, False])).tolist() == [10.5, 10.25, 10.0, 10.25]
