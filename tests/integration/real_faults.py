"""Real faults in small multi-process jobs (CPU PyTorch, gloo): the harness of test_real_faults.py, and its fixtures.

    python tests/integration/real_faults.py tests/data/real [CASE ...]   # rerun the jobs; write tests/data/real/CASE.parquet

Four ranks run ``fault_rank.py`` (profiled like the agent profiles, sampled by the agent's
sampler); rank ``CULPRIT`` carries the fault:

* ``link``: every rank in a network namespace of its own on one bridge, the culprit's link
  limited by ``tc qdisc ... tbf`` in both directions; its NIC counters sampled at 2 kHz.
* ``contention``: a busy process at nice -10 (a host service of raised priority) pinned to the
  culprit's CPU; the culprit alone on that CPU, the other ranks on the other one.
* ``dataloader``: the culprit's ``DataLoader`` takes 48 ms per batch (its dataset sleeps: slow storage).
* ``compute``: extra matrix products in the culprit's ``forward``.

A fixture is what the diagnosis reads of such a run: every worker's function table per step
(the host-side summary, hardware mean/sd/p95 included) with ``worker``, ``step``,
``step_time_us``, ``host``, ``device`` and ``hardware`` columns; :func:`load_fixture` turns
it back into ``lockstep diagnose``'s inputs.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
RANK = HERE / "fault_rank.py"
WORLD = 4
CULPRIT = 2
LINK_RATE = "100mbit"
NS_PREFIX = "lsrf"  # namespaces lsrf-<pid>-<rank>, bridge lsrfb<pid>, host-side veths lsrfh<pid>x<rank>
CASES = ("link", "contention", "dataloader", "compute")


@dataclass(frozen=True)
class Expect:
    """How the fault must be named."""

    worker: int
    function: str  # a regular expression
    cause: str


EXPECT = {
    "link": Expect(CULPRIT, r"gloo:all_reduce", "nic"),
    "contention": Expect(CULPRIT, r"forward|backward|Optimizer|aten::", "host_cpu_contention"),
    "dataloader": Expect(CULPRIT, r"DataLoader", "dataloader"),
    "compute": Expect(CULPRIT, r"forward", "rank_specific_code"),
}


class Unavailable(RuntimeError):
    """This machine cannot make the fault (the message says why); the test skips."""


# --------------------------------------------------------------------------- network namespaces and tc


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def sweep_stale() -> None:
    """Remove namespaces and bridges that an earlier run, killed before its clean-up, left behind."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        m = re.match(rf"{NS_PREFIX}-(\d+)-\d+\b", line)
        if m and not _alive(int(m.group(1))):
            _ip("netns", "del", line.split()[0], check=False)
    for line in _ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        m = re.search(rf"\b({NS_PREFIX}b(\d+))\b", line)
        if m and not _alive(int(m.group(2))):
            _ip("link", "del", m.group(1), check=False)


@contextlib.contextmanager
def network(world: int, limited: int, rate: str):
    """``world`` namespaces on one bridge, address 10.231.0.(rank+1); the link of rank ``limited`` shaped to ``rate``.

    Yields the namespaces' names.  Everything made is removed on the way out, also when the
    body fails (deleting a namespace deletes its veth pair and their qdiscs).
    """
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise Unavailable("iproute2 (ip, tc) is not installed")
    sweep_stale()
    pid = os.getpid()
    names = [f"{NS_PREFIX}-{pid}-{r}" for r in range(world)]
    bridge = f"{NS_PREFIX}b{pid}"
    made: list[str] = []
    try:
        p = _ip("netns", "add", names[0], check=False)
        if p.returncode != 0:
            raise Unavailable(f"ip netns add is not allowed here: {p.stderr.strip()}")
        made.append(names[0])
        for ns in names[1:]:
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for r, ns in enumerate(names):
            host_side, ns_side = f"{NS_PREFIX}h{pid}x{r}", f"{NS_PREFIX}n{pid}x{r}"
            _ip("link", "add", ns_side, "type", "veth", "peer", "name", host_side)
            _ip("link", "set", host_side, "master", bridge)
            _ip("link", "set", host_side, "up")
            _ip("link", "set", ns_side, "netns", ns)
            _ip("-n", ns, "link", "set", ns_side, "name", f"eth{r}")
            _ip("-n", ns, "addr", "add", f"10.231.0.{r + 1}/24", "dev", f"eth{r}")
            _ip("-n", ns, "link", "set", f"eth{r}", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if r == limited:  # a degraded link: slow both ways
                tbf = ["root", "tbf", "rate", rate, "burst", "32kbit", "latency", "100ms"]
                subprocess.run(
                    ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", f"eth{r}", *tbf],
                    check=True,
                    capture_output=True,
                )
                subprocess.run(["tc", "qdisc", "add", "dev", host_side, *tbf], check=True, capture_output=True)
        yield names
    finally:
        for ns in made:
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", bridge, check=False)


# --------------------------------------------------------------------------- a noisy neighbour


@contextlib.contextmanager
def busy_process(cpu: int):
    """A process that spins on ``cpu`` at nice -10 (a host service of raised priority), or at 0 where that is not allowed."""

    def pin() -> None:
        os.sched_setaffinity(0, {cpu})
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, -10)

    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- the job


def run_job(case: str, out: Path, *, steps: int = 8, hz: float = 2000.0, timeout_s: float = 150.0) -> Path:
    """Run the case's job; ``out`` receives the ranks' traces, ``samples.parquet`` and their logs."""
    from lockstep.broker import free_port

    out.mkdir(parents=True, exist_ok=True)
    base = [
        sys.executable,
        str(RANK),
        "--world",
        str(WORLD),
        "--out",
        str(out),
        "--case",
        case,
        "--culprit",
        str(CULPRIT),
        "--steps",
        str(steps),
        "--hz",
        str(hz),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with contextlib.ExitStack() as stack:
        if case == "link":
            names = stack.enter_context(network(WORLD, CULPRIT, LINK_RATE))
            cmds = [
                [
                    "ip",
                    "netns",
                    "exec",
                    names[r],
                    *base,
                    "--rank",
                    str(r),
                    "--master",
                    "10.231.0.1:29500",
                    "--nic",
                    f"eth{r}",
                ]
                for r in range(WORLD)
            ]
        else:
            master = f"127.0.0.1:{free_port()}"
            # the NIC the agent would sample: GLOO_SOCKET_IFNAME's (the loopback, shared by the ranks here), not the host's eth0
            cmds = [[*base, "--rank", str(r), "--master", master, "--nic", "lo"] for r in range(WORLD)]
            env["GLOO_SOCKET_IFNAME"] = "lo"
        go = out / "go"
        if case == "contention":
            if (os.cpu_count() or 1) < 2:
                raise Unavailable("needs two CPUs: one for the culprit and its noisy neighbour, one for the others")
            # longer compute phases: a waking task's first milliseconds run ahead of the neighbour (the scheduler's sleeper credit)
            cmds = [
                [*c, "--cpus", "1" if r == CULPRIT else "0", "--go", str(go), "--batch", "128"]
                for r, c in enumerate(cmds)
            ]
        procs = []
        try:
            for r, cmd in enumerate(cmds):
                rank_env = {**env, "GLOO_SOCKET_IFNAME": f"eth{r}"} if case == "link" else env
                log = (out / f"rank{r}.log").open("wb")
                procs.append(subprocess.Popen(cmd, env=rank_env, stdout=log, stderr=subprocess.STDOUT))
                log.close()
            deadline = time.monotonic() + timeout_s
            if (
                case == "contention"
            ):  # the neighbour starts once the ranks are set up (it would slow the culprit's start-up too)
                while not all(go.with_name(f"go.rank{r}").exists() for r in range(WORLD)):
                    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                        raise RuntimeError(
                            f"the {case} job did not get ready:\n{(out / 'rank0.log').read_text()[-3000:]}"
                        )
                    time.sleep(0.05)
                stack.enter_context(busy_process(1))
                go.touch()
            for r, p in enumerate(procs):
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                if rc != 0:
                    raise RuntimeError(
                        f"rank {r} of the {case} job failed ({rc}):\n{(out / f'rank{r}.log').read_text()[-3000:]}"
                    )
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
                    p.wait()
    pq.write_table(
        pa.concat_tables([pq.read_table(out / f"samples{r}.parquet") for r in range(WORLD)]), out / "samples.parquet"
    )
    return out


def traces(out: Path) -> list[Path]:
    return [out / f"rank{r}.json" for r in range(WORLD)]


def diagnose_cli(out: Path) -> list[dict]:
    """``lockstep diagnose`` on the run's traces and samples, as a user runs it: its findings."""
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "lockstep",
            "diagnose",
            *map(str, traces(out)),
            "--samples",
            str(out / "samples.parquet"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if p.returncode != 0:
        raise RuntimeError(f"lockstep diagnose failed: {p.stderr}")
    return json.loads(p.stdout)


def named(findings: list[dict], expect: Expect) -> dict | None:
    """The first finding that names the expected worker (alone), function and cause."""
    for f in findings:
        if (
            f["workers"] == [expect.worker]
            and re.search(expect.function, f["function"] or "")
            and f["cause"] == expect.cause
        ):
            return f
    return None


#: cases today's rules do not name in every run on this machine, and why (their tests are expected failures when they miss)
AWAITING = {
    "contention": "three healthy ranks share the other CPU of this 2-CPU machine and its load, so how much less CPU the "
    "culprit got than they did varies from run to run; the costliest slowed function may be backward, whose CPU share "
    "includes the all-reduce waits on every rank, and then 4x the peers' time reads as rank_specific_code",
}


def check_named(case: str, findings: list[dict]) -> None:
    """Assert that ``findings`` name the case's fault (an expected failure for the cases in AWAITING), and blame nobody else."""
    import pytest

    expect = EXPECT[case]
    found = named(findings, expect)
    if found is None and case in AWAITING:
        pytest.xfail(f"{AWAITING[case]}; today: {summary(findings)}")
    assert found is not None, (
        f"expected worker {expect.worker}, {expect.function}, {expect.cause}; got {summary(findings)}"
    )
    assert all(f["workers"] in ([], [expect.worker]) or f["confidence"] < 0.5 for f in findings), summary(findings)


def summary(findings: list[dict]) -> str:
    return (
        "; ".join(f"{f['scope']} {f['workers']} {f['function']} {f['cause']} {f['confidence']:.2f}" for f in findings)
        or "no finding"
    )


# --------------------------------------------------------------------------- fixtures


META = ("worker", "step", "step_time_us", "host", "device", "hardware")


def write_fixture(out: Path, path: Path, min_share: float = 0.001) -> None:
    """The run's diagnosis inputs (function tables per worker and step, hardware mean/sd/p95 included) as one Parquet file.

    Functions below ``min_share`` of the step are left out, as the agent leaves them out of its feature batches.
    """
    from lockstep.app.offline import load_inputs

    inputs = load_inputs(traces(out), None, out / "samples.parquet")
    parts = []
    for s in inputs.summaries:
        f = s.functions
        share = pc.max_element_wise(f.column("critical_us"), f.column("total_us"))
        f = f.filter(pc.greater_equal(pc.divide(pc.cast(share, pa.float64()), s.step_time_us), min_share))
        meta = inputs.workers[s.worker]
        values = {
            "worker": s.worker,
            "step": s.step,
            "step_time_us": s.step_time_us,
            "host": meta.host,
            "device": meta.device,
            "hardware": inputs.hardware[s.worker],
        }
        for i, (name, v) in enumerate(values.items()):
            f = f.add_column(i, name, pa.array([v] * f.num_rows))
        parts.append(f)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.concat_tables(parts), path, compression="zstd")


def load_fixture(path: Path):
    """A fixture -> the inputs of :func:`lockstep.app.offline.diagnose`."""
    from lockstep.app.offline import Inputs
    from lockstep.producers.agent.summarise import StepSummary
    from lockstep.schemas import functions as ft
    from lockstep.schemas.records import WorkerMeta

    t = pq.read_table(path).sort_by([("worker", "ascending"), ("step", "ascending")])
    worker, step = t.column("worker").to_numpy(), t.column("step").to_numpy()
    starts = [0, *(i for i in range(1, t.num_rows) if (worker[i], step[i]) != (worker[i - 1], step[i - 1])), t.num_rows]
    inputs = Inputs(files=1)
    for a, b in itertools.pairwise(starts):
        part = t.slice(a, b - a)
        first = part.slice(0, 1).to_pylist()[0]
        w = int(first["worker"])
        inputs.workers.setdefault(w, WorkerMeta(rank=w, host=first["host"], device=first["device"]))
        inputs.hardware[w] = first["hardware"]
        inputs.summaries.append(
            StepSummary(w, int(first["step"]), float(first["step_time_us"]), ft.conform(part.drop_columns(list(META))))
        )
    return inputs


def main(argv: list[str]) -> int:
    import tempfile

    dest = Path(argv[0])
    for case in argv[1:] or CASES:
        with tempfile.TemporaryDirectory() as tmp:
            out = run_job(case, Path(tmp))
            write_fixture(out, dest / f"{case}.parquet")
            print(f"{case}: {summary(diagnose_cli(out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
