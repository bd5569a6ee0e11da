"""Fleet topology: hosts, GPUs, NICs (bonds), switches and the parallel ranks of one job.

Ranks follow Megatron's order: tensor-parallel rank fastest, then data-parallel,
then pipeline stage.  So a tensor-parallel group is ``tp`` consecutive ranks on
one host (NVLink), a data-parallel group is every ``dp``-th block of them across
hosts (NICs), and a pipeline stage is a contiguous block of whole hosts.

Every worker carries the peer-group labels ``dp``, ``pp``, ``tp`` and ``role``
(``embedding`` for the first pipeline stage, ``loss`` for the last,
``transformer`` in between, ``all`` without pipeline parallelism): workers of
one stage and role do the same work.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ...schemas.errors import LockstepError
from ...schemas.records import WorkerMeta


class TopologyError(LockstepError, ValueError):
    pass


@dataclass(frozen=True)
class Topology:
    workers: int = 64
    gpus_per_host: int = 8
    nics_per_host: int = 2  # bonds per host; the GPUs share them evenly (4 GPUs behind each of 2 bonds)
    hosts_per_switch: int = 4  # hosts behind one leaf switch
    pp: int = 1  # pipeline-parallel stages
    tp: int = 1  # tensor-parallel width (inside a host)

    def __post_init__(self) -> None:
        for name in ("workers", "gpus_per_host", "nics_per_host", "hosts_per_switch", "pp", "tp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise TopologyError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.workers % (self.pp * self.tp):
            raise TopologyError(f"workers ({self.workers}) must be a multiple of pp*tp ({self.pp * self.tp})")
        if self.gpus_per_host % self.nics_per_host:
            raise TopologyError("gpus_per_host must be a multiple of nics_per_host")
        if self.gpus_per_host % self.tp:
            raise TopologyError(
                f"tp ({self.tp}) must divide gpus_per_host ({self.gpus_per_host}): tensor parallelism stays inside a host"
            )
        stage = self.workers // self.pp
        if self.pp > 1 and stage % self.gpus_per_host:
            raise TopologyError(
                f"a pipeline stage ({stage} workers) must fill whole hosts of {self.gpus_per_host} GPUs"
            )
        if self.workers > self.gpus_per_host and self.workers % self.gpus_per_host:
            raise TopologyError(f"workers ({self.workers}) must fill whole hosts of {self.gpus_per_host} GPUs")

    @property
    def dp(self) -> int:
        return self.workers // (self.pp * self.tp)

    @property
    def hosts(self) -> int:
        return -(-self.workers // self.gpus_per_host)

    @property
    def switches(self) -> int:
        return -(-self.hosts // self.hosts_per_switch)

    @property
    def gpus_per_nic(self) -> int:
        return self.gpus_per_host // self.nics_per_host

    @cached_property
    def arrays(self) -> dict[str, np.ndarray]:
        """Per-worker indices: rank, host, local (GPU index), tp, dp, pp, nic (global bond index), switch."""
        r = np.arange(self.workers)
        host = r // self.gpus_per_host
        local = r % self.gpus_per_host
        tp_rank = r % self.tp
        dp_rank = (r // self.tp) % self.dp
        pp_rank = r // (self.tp * self.dp)
        nic = host * self.nics_per_host + local // self.gpus_per_nic
        switch = host // self.hosts_per_switch
        return {
            "rank": r,
            "host": host,
            "local": local,
            "tp": tp_rank,
            "dp": dp_rank,
            "pp": pp_rank,
            "nic": nic,
            "switch": switch,
        }

    def role(self, stage: int) -> str:
        if self.pp == 1:
            return "all"
        return "embedding" if stage == 0 else "loss" if stage == self.pp - 1 else "transformer"

    def host_name(self, h: int) -> str:
        return f"node{h:04d}"

    def device_name(self, worker: int) -> str:
        return f"{self.host_name(worker // self.gpus_per_host)}/gpu{worker % self.gpus_per_host}"

    def nic_name(self, n: int) -> str:
        per = self.nics_per_host
        return f"{self.host_name(n // per)}/bond{n % per}"

    def switch_name(self, s: int) -> str:
        return f"leaf{s:03d}"

    def nic_index(self, name: str) -> int:
        for n in range(self.hosts * self.nics_per_host):
            if self.nic_name(n) == name:
                return n
        raise TopologyError(f"no NIC named {name!r} (names look like {self.nic_name(0)!r})")

    def switch_index(self, name: str) -> int:
        for s in range(self.switches):
            if self.switch_name(s) == name:
                return s
        raise TopologyError(
            f"no switch named {name!r} (names look like {self.switch_name(0)!r}, 0..{self.switches - 1})"
        )

    def meta(self) -> list[WorkerMeta]:
        a = self.arrays
        return [
            WorkerMeta(
                rank=int(a["rank"][i]),
                host=self.host_name(int(a["host"][i])),
                device=self.device_name(i),
                local_rank=int(a["local"][i]),
                nic=self.nic_name(int(a["nic"][i])),
                switch=self.switch_name(int(a["switch"][i])),
                labels={
                    "dp": str(int(a["dp"][i])),
                    "pp": str(int(a["pp"][i])),
                    "tp": str(int(a["tp"][i])),
                    "role": self.role(int(a["pp"][i])),
                },
            )
            for i in range(self.workers)
        ]
