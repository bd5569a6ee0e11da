"""Who this worker is: rank, host, device, NIC, peer-group labels, found where possible.

Explicit settings win; then torch.distributed (when initialised), then the
launchers' environment variables (torchrun, Slurm, Open MPI), then the host
itself (default route for the NIC, bonding in /sys, CUDA and NVML for the GPU).
The pure helpers take the environment and file contents as arguments.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from ...schemas.records import WorkerMeta
from .settings import AgentConfig

log = logging.getLogger("lockstep.agent")

RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
WORLD_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
#: environment variables naming the interface(s) collective traffic leaves through
NIC_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


@dataclass(frozen=True)
class Identity:
    meta: WorkerMeta
    world_size: int
    gpu_uuid: str = ""  # NVML can be opened by UUID; "" without a GPU
    world_known: bool = False  # the world size was set or discovered (not the default of 1)


def first_int(env: dict[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        value = env.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return None


def default_route_interface(route_table: str) -> str:
    """The interface of the default route, from the text of /proc/net/route."""
    for line in route_table.splitlines()[1:]:
        parts = line.split()
        if len(parts) > 3 and parts[1] == "00000000" and int(parts[3], 16) & 0x2:  # destination 0, RTF_GATEWAY
            return parts[0]
    return ""


def nic_from_env(env: dict[str, str], local_rank: int) -> str:
    """The NIC NCCL/Gloo are told to use: an InfiniBand HCA per local rank (rail-aligned), or a socket interface."""
    hcas = env.get("NCCL_IB_HCA", "")
    if hcas and not hcas.startswith("^"):
        names = [h.lstrip("=").split(":")[0] for h in hcas.split(",") if h.strip()]
        if names:
            return names[local_rank % len(names)]
    for var in NIC_VARS:
        value = env.get(var, "")
        if value and not value.startswith("^"):
            return value.lstrip("=").split(",")[0]
    return ""


def bond_of(nic: str, sys_class_net: Path = Path("/sys/class/net")) -> str:
    """The bond a NIC is enslaved to, or the NIC itself."""
    master = sys_class_net / nic / "master"
    try:
        return master.resolve().name if master.exists() else nic
    except OSError:
        return nic


def _torch_distributed() -> tuple[int, int] | None:
    dist = sys.modules.get("torch.distributed")  # never import torch just to find out
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        log.debug("torch.distributed not usable for the rank", exc_info=True)
    return None


def _megatron_labels() -> dict[str, str]:
    ps = sys.modules.get("megatron.core.parallel_state")
    try:
        if ps is not None and ps.model_parallel_is_initialized():
            return {
                "dp": str(ps.get_data_parallel_rank()),
                "pp": str(ps.get_pipeline_model_parallel_rank()),
                "tp": str(ps.get_tensor_model_parallel_rank()),
            }
    except Exception:
        log.debug("megatron parallel state not readable", exc_info=True)
    return {}


def _jax_gpu(host: str) -> str:
    """``<host>/gpu<N>`` of the first accelerator of a JAX process (already imported: never imported here)."""
    jax = sys.modules.get("jax")
    try:
        devices = [] if jax is None else jax.local_devices()
    except Exception:
        log.debug("JAX devices not readable", exc_info=True)
        return ""
    gpus = [d for d in devices if str(getattr(d, "platform", "")).lower() in ("gpu", "cuda", "rocm")]
    if not gpus:
        return ""
    local = getattr(gpus[0], "local_hardware_id", None)
    return f"{host}/gpu{int(gpus[0].id if local is None else local)}"


def _gpu(host: str, local_rank: int, env: dict[str, str]) -> tuple[str, str]:
    """(device name, NVML UUID) of the GPU this process uses; ("", "") without one (a JAX process's GPU
    has no UUID here)."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_available():
            return _jax_gpu(host), ""
        cur = torch.cuda.current_device()
        uuid = str(getattr(torch.cuda.get_device_properties(cur), "uuid", "") or "")
        uuid = uuid if not uuid or uuid.startswith("GPU-") else f"GPU-{uuid}"
    except Exception:
        log.debug("CUDA device not readable", exc_info=True)
        return "", ""
    from .nvml import physical_index

    index = physical_index(uuid)
    if index is None:  # no NVML: map through CUDA_VISIBLE_DEVICES when it lists indices
        visible = [v for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        index = int(visible[cur]) if cur < len(visible) and visible[cur].strip().isdigit() else cur
    return f"{host}/gpu{index}", uuid


def discover(cfg: AgentConfig, env: dict[str, str] | None = None) -> Identity:
    env = dict(os.environ if env is None else env)
    dist = _torch_distributed()
    rank = cfg.rank if cfg.rank is not None else (dist[0] if dist else first_int(env, RANK_VARS))
    world = cfg.world_size if cfg.world_size is not None else (dist[1] if dist else first_int(env, WORLD_VARS))
    local_rank = cfg.local_rank if cfg.local_rank is not None else first_int(env, LOCAL_RANK_VARS)
    known = bool(world)
    rank, world, local_rank = rank or 0, world or 1, local_rank or 0
    host = cfg.host or socket.gethostname()
    device, uuid = (cfg.device, "") if cfg.device else _gpu(host, local_rank, env)
    if not device:
        device = f"{host}/cpu"
    nic = cfg.nic
    if nic is None:
        nic = nic_from_env(env, local_rank)
        if not nic:
            try:
                nic = default_route_interface(Path("/proc/net/route").read_text())
            except OSError:
                nic = ""
        nic = bond_of(nic) if nic else ""
    labels = {**_megatron_labels(), **cfg.labels}
    meta = WorkerMeta(
        rank=rank, host=host, device=device, local_rank=local_rank, nic=nic, switch=cfg.switch, labels=labels
    )
    return Identity(meta=meta, world_size=world, gpu_uuid=uuid, world_known=known)
