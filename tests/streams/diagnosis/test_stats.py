"""Vectorised group statistics against numpy, group by group."""

from __future__ import annotations

import numpy as np
import pytest

from lockstep.streams.diagnosis.stats import Layout, group_median


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
