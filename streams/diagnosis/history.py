"""The job's own baseline: what its earlier healthy windows looked like.

Job-wide problems have no outlier among peers; one way to see them is against
the same job's earlier healthy windows ("every worker is slower in this
function than last time": a framework or library regression).  The window
stage keeps one :class:`JobHistory` per job (in the stream processor: a faust
table written inside stream iteration), passes it to
:func:`~lockstep.streams.diagnosis.diagnose_window` and stores the history it
returns.  A window folds into the baseline only when it was healthy (no
worker or group finding, no regression; a job-wide expected-range finding
describes the job itself) and nearly complete.

Stored as JSON with a version, like every record: the changelog outlives
processor versions.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pyarrow as pa

from ...schemas.errors import LockstepError
from .stats import group_median

VERSION = 1
MIN_COVERAGE = 0.9  # a window that saw fewer of the job's workers does not update the baseline


class HistoryError(LockstepError, ValueError):
    """A stored job history is unreadable or of an unknown version."""


class JobHistory(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Per (peer group, function): the typical work per step in the job's healthy windows."""

    v: int = VERSION
    job: str
    windows: int = 0  # healthy windows folded in
    last_window: str = ""
    updated_at: float = 0.0
    group: list[str] = []
    function: list[str] = []
    kind: list[str] = []
    work_us: list[float] = []  # moving average of the per-window median work
    step_time_us: list[float] = []  # ... and of the group's median step time
    # ... and of the work's spread from step to step (1.4826 x MAD); absent in histories written before it
    work_spread_us: list[float] = []

    def work_of(self) -> dict[tuple[str, str], float]:
        """(peer group, function) -> typical work per step in the healthy windows."""
        return dict(zip(zip(self.group, self.function), self.work_us))

    def encode(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def decode(cls, text: str | bytes) -> JobHistory:
        try:
            h = msgspec.json.decode(text, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HistoryError(f"unreadable job history ({exc})") from None
        if h.v != VERSION:
            raise HistoryError(f"job history version {h.v} is not supported (this build reads {VERSION})")
        if not len(h.group) == len(h.function) == len(h.kind) == len(h.work_us) == len(h.step_time_us):
            raise HistoryError("job history columns differ in length")
        if h.work_spread_us and len(h.work_spread_us) != len(h.group):
            raise HistoryError("job history columns differ in length")
        return h


def window_medians(groups: pa.Table) -> pa.Table:
    """Per (group, function) of a window's concatenated group tables: median work and step time over steps, and the
    work's spread from step to step (1.4826 x MAD)."""
    if groups.num_rows == 0:
        return pa.table(
            {
                "group": pa.array([], pa.string()),
                "function": pa.array([], pa.string()),
                "kind": pa.array([], pa.string()),
                "work_us": pa.array([], pa.float64()),
                "step_time_us": pa.array([], pa.float64()),
                "work_spread_us": pa.array([], pa.float64()),
            }
        )
    g = groups.column("group").to_numpy(zero_copy_only=False).astype(str)
    f = groups.column("function").to_numpy(zero_copy_only=False).astype(str)
    keys, first, inv = np.unique(np.char.add(np.char.add(g, "\x1f"), f), return_index=True, return_inverse=True)
    n = keys.size
    work = groups.column("work_us").to_numpy()
    med = group_median(work, inv, n)
    return pa.table(
        {
            "group": g[first],
            "function": f[first],
            "kind": groups.column("kind").to_numpy(zero_copy_only=False).astype(str)[first],
            "work_us": med,
            "step_time_us": group_median(groups.column("step_time_us").to_numpy(), inv, n),
            "work_spread_us": 1.4826 * group_median(np.abs(work - med[inv]), inv, n),
        }
    )


def fold(history: JobHistory | None, job: str, window: str, medians: pa.Table, weight: float, now: float) -> JobHistory:
    """The baseline with one more healthy window folded in (moving average with ``weight`` for the new one)."""
    h = history or JobHistory(job=job)
    w = weight if h.windows else 1.0
    new = {c: medians.column(c).to_numpy(zero_copy_only=False) for c in medians.column_names}
    group = np.concatenate([np.asarray(h.group, dtype=object), new["group"].astype(object)])
    function = np.concatenate([np.asarray(h.function, dtype=object), new["function"].astype(object)])
    kind = np.concatenate([np.asarray(h.kind, dtype=object), new["kind"].astype(object)])
    keys = np.char.add(np.char.add(group.astype(str), "\x1f"), function.astype(str))
    uniq, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    n_old = len(h.group)
    out = {}
    for c, old in (
        ("work_us", h.work_us),
        ("step_time_us", h.step_time_us),
        ("work_spread_us", h.work_spread_us or [np.nan] * n_old),
    ):
        before = np.full(uniq.size, np.nan)
        before[inv[:n_old]] = np.asarray(old, dtype=np.float64)
        now_ = np.full(uniq.size, np.nan)
        now_[inv[n_old:]] = new[c].astype(np.float64)
        out[c] = np.where(np.isnan(before), now_, np.where(np.isnan(now_), before, (1 - w) * before + w * now_))
    return JobHistory(
        job=job,
        windows=h.windows + 1,
        last_window=window,
        updated_at=now,
        group=group[first].tolist(),
        function=function[first].tolist(),
        kind=kind[first].tolist(),
        work_us=out["work_us"].tolist(),
        step_time_us=out["step_time_us"].tolist(),
        work_spread_us=np.nan_to_num(out["work_spread_us"]).tolist(),
    )
