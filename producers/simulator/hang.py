"""A simulated hang (``lockstep demo --fault hang``): from a step on the job makes no progress, because one worker
stopped in its data loading; the simulated agents answer the hang trigger as real agents do (a ``HangReport`` each,
:mod:`lockstep.producers.agent.hang`): the culprit from inside its dataset's ``__getitem__``, the others from the
backward pass, where the gradient all-reduce waits for it."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ...schemas.records import HangReport, ProfileTrigger, WorkerMeta

#: where the simulated workers are: the culprit, and the peers that wait for it
CULPRIT_REGION = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
CULPRIT_FRAME = "dataset.py(88): __getitem__"
PEERS_FRAME = "graph.py(829): _engine_run_backward"


@dataclass(frozen=True)
class SimulatedHang:
    """Worker ``culprit`` never finishes step ``at_step``; so nobody does."""

    culprit: int
    at_step: int

    def reports(self, meta: list[WorkerMeta], trig: ProfileTrigger, tenant: str = "") -> list[HangReport]:
        now = time.time()
        by_host: dict[str, list[int]] = {}
        for m in meta:
            by_host.setdefault(m.host, []).append(m.rank)
        out = []
        for m in meta:
            culprit = m.rank == self.culprit
            out.append(
                HangReport(
                    job=trig.job,
                    window=trig.window,
                    worker=m.rank,
                    host=m.host,
                    expected_workers=trig.expected_workers,
                    device=m.device,
                    tenant=tenant,
                    last_step=self.at_step - 1,
                    frame=CULPRIT_FRAME if culprit else PEERS_FRAME,
                    region=CULPRIT_REGION if culprit else "",
                    collective="all_reduce",
                    collective_seq=self.at_step,  # one stop-flag all-reduce per step, as the real test job does
                    collective_group="default",
                    collective_open=False,
                    host_workers=by_host[m.host],
                    sent_at=now,
                )
            )
        return out
