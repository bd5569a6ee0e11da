"""Healthy jobs with a checkpoint whose write varies: how often does a window name a worker?

    python -m tests.noisy_periodic [--windows 30]

Every worker is healthy: forward and backward (10 ms each, 3% noise) every step, and a checkpoint every third step
(3 of a window's 10) of 6 ms whose duration varies lognormally from one worker and step to the next by the
write's spread (10%, 20%, 30%, 50%).  Of three occurrences, some worker is above its peers at two in most windows
by chance; a diagnosis that needs half of them names it (issue 21, tenth pass; docs/real-faults.md).  Prints, per
spread and job size, the windows (seeds 0 .. --windows - 1) with a worker finding.
"""

from __future__ import annotations

import argparse

import numpy as np

from tests.streams.diagnosis.test_localise import STEPS, noisy, window


def named_windows(workers: int, spread: float, windows: int) -> int:
    """Of ``windows`` seeded windows of a healthy ``workers``-worker job, those with a worker finding."""
    named = 0
    for seed in range(windows):
        own = noisy(workers, 3, 10_000.0, seed=seed)
        own[:, :, 2] = np.nan
        every_third = np.arange(1, STEPS, 3)
        rng = np.random.default_rng(100 + seed)
        own[every_third, :, 2] = 6_000.0 * np.exp(spread * rng.standard_normal((every_third.size, workers)))
        _, d = window(own, names=["forward", "backward", "save_checkpoint"])
        named += any(f.scope == "worker" for f in d.findings)
    return named


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=30)
    args = ap.parse_args()
    print(f"write's spread  workers  windows of {args.windows} with a worker finding")
    for spread in (0.1, 0.2, 0.3, 0.5):
        for workers in (3, 4, 8):
            print(f"{spread:>14.0%}  {workers:>7}  {named_windows(workers, spread, args.windows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
