"""Worker identity from explicit settings, launcher variables and the host."""

from lockstep.producers.agent import settings as agent_settings
from lockstep.producers.agent.meta import default_route_interface, discover, first_int, nic_from_env

ROUTES = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth1\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
bond0\t00000000\t0100A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0
"""


def cfg(**kw):
    return agent_settings.load({"job": "j", "bootstrap_servers": "k:1", **kw}, {})


def test_ranks_from_torchrun_slurm_or_mpi_variables():
    assert first_int({"RANK": "5", "SLURM_PROCID": "9"}, ("RANK", "SLURM_PROCID")) == 5
    assert first_int({"SLURM_PROCID": "9"}, ("RANK", "SLURM_PROCID")) == 9
    ident = discover(cfg(), {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "GLOO_SOCKET_IFNAME": "ens5"})
    assert (ident.meta.rank, ident.world_size, ident.meta.local_rank, ident.meta.nic) == (3, 8, 1, "ens5")
    assert ident.meta.device.endswith("/cpu")  # no GPU here


def test_explicit_settings_win():
    ident = discover(
        cfg(rank=7, world_size=16, host="h9", device="h9/gpu3", nic="bond1", switch="leaf4", labels="pp=2"),
        {"RANK": "3"},
    )
    m = ident.meta
    assert (m.rank, ident.world_size, m.host, m.device, m.nic, m.switch, m.labels) == (
        7,
        16,
        "h9",
        "h9/gpu3",
        "bond1",
        "leaf4",
        {"pp": "2"},
    )


def test_nic_from_nccl_settings_and_the_default_route():
    assert nic_from_env({"NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1,mlx5_2:1"}, local_rank=4) == "mlx5_1"  # one HCA per rail
    assert nic_from_env({"NCCL_IB_HCA": "^mlx5_3", "NCCL_SOCKET_IFNAME": "=eth2,eth3"}, 0) == "eth2"
    assert nic_from_env({"NCCL_SOCKET_IFNAME": "^docker"}, 0) == ""  # an exclusion names no NIC
    assert default_route_interface(ROUTES) == "bond0"
    assert default_route_interface(ROUTES.splitlines()[0]) == ""


def test_a_jax_process_names_its_accelerator_and_a_cpu_only_one_its_cpu(monkeypatch):
    """JAX's devices decide when torch has no CUDA: its first GPU by its local hardware id, else the CPU (the
    job's CPU-h against GPU-h follow from this name). JAX stands in as a module holding two devices."""
    import sys
    import types

    dev = types.SimpleNamespace
    jax = types.ModuleType("jax")
    jax.local_devices = lambda: [dev(platform="gpu", id=4, local_hardware_id=0), dev(platform="gpu", id=5)]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "jax", jax)
    assert discover(cfg(host="h1"), {}).meta.device == "h1/gpu0"
    jax.local_devices = lambda: [dev(platform="cpu", id=0)]  # type: ignore[attr-defined]
    assert discover(cfg(host="h1"), {}).meta.device == "h1/cpu"
    jax.local_devices = lambda: (_ for _ in ()).throw(RuntimeError("no backend"))  # type: ignore[attr-defined]
    assert discover(cfg(host="h1"), {}).meta.device == "h1/cpu"
