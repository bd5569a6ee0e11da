"""Fleet topology: hosts, GPUs, NICs, switches and parallel ranks of one job."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ...schemas.records import WorkerMeta


class TopologyError(ValueError):
    pass


@dataclass(frozen=True)
class Topology:
    workers: int = 64
    gpus_per_host: int = 8
    nics_per_host: int = 2  # GPUs share NICs evenly (a bond per GPU pair on 8-GPU hosts with 4 NICs, ...)
    hosts_per_switch: int = 4
    pp: int = 1  # pipeline-parallel stages
    tp: int = 1  # tensor-parallel width (inside a host)

    def __post_init__(self) -> None:
        if self.workers < 1 or self.gpus_per_host < 1:
            raise TopologyError("workers and gpus_per_host must be >= 1")
        if self.workers % (self.pp * self.tp):
            raise TopologyError(f"workers ({self.workers}) must be a multiple of pp*tp ({self.pp * self.tp})")
        if self.gpus_per_host % self.nics_per_host:
            raise TopologyError("gpus_per_host must be a multiple of nics_per_host")

    @property
    def dp(self) -> int:
        return self.workers // (self.pp * self.tp)

    @property
    def hosts(self) -> int:
        return -(-self.workers // self.gpus_per_host)

    @cached_property
    def arrays(self) -> dict[str, np.ndarray]:
        r = np.arange(self.workers)
        host = r // self.gpus_per_host
        local = r % self.gpus_per_host
        # Megatron order: tp fastest, then dp, then pp
        tp_rank = r % self.tp
        dp_rank = (r // self.tp) % self.dp
        pp_rank = r // (self.tp * self.dp)
        nic = host * self.nics_per_host + local // (self.gpus_per_host // self.nics_per_host)
        switch = host // self.hosts_per_switch
        return {"rank": r, "host": host, "local": local, "tp": tp_rank, "dp": dp_rank, "pp": pp_rank, "nic": nic, "switch": switch}

    def host_name(self, h: int) -> str:
        return f"node{h:04d}"

    def nic_name(self, n: int) -> str:
        per = self.nics_per_host
        return f"{self.host_name(n // per)}/bond{n % per}"

    def switch_name(self, s: int) -> str:
        return f"leaf{s:03d}"

    def meta(self) -> list[WorkerMeta]:
        a = self.arrays
        return [
            WorkerMeta(
                rank=int(a["rank"][i]),
                host=self.host_name(int(a["host"][i])),
                device=f"{self.host_name(int(a['host'][i]))}/gpu{int(a['local'][i])}",
                local_rank=int(a["local"][i]),
                nic=self.nic_name(int(a["nic"][i])),
                switch=self.switch_name(int(a["switch"][i])),
                labels={"dp": str(int(a["dp"][i])), "pp": str(int(a["pp"][i])), "tp": str(int(a["tp"][i]))},
            )
            for i in range(self.workers)
        ]
