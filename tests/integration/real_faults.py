"""Real faults in small multi-process jobs (CPU PyTorch, gloo): the harness of test_real_faults.py, and its fixtures.

    python tests/integration/real_faults.py tests/data/real [CASE ...]   # rerun the jobs; write tests/data/real/CASE.parquet
    python tests/integration/real_faults.py --corpus [CASE_ID ...]        # record the real-fault corpus (missing cases, or those named)
    python tests/integration/real_faults.py --long STEPS DEST [CASE_ID ...]  # every case (corpus, holdout) again in runs of
                                                                            # STEPS steps, into DEST (scripts/window_length.py)

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

The real-fault corpus (``--corpus``, issue 21; ``tests/data/real/corpus/README.md``): :data:`MECHANISMS` (17, in six
resource classes) at two severities on jobs of 2, 3, 4 and 8 ranks, some with two culprits, and healthy jobs with
and without a noisy neighbour (:func:`corpus_cases`); :func:`record_case` runs one and writes its fixture and its
manifest (:class:`lockstep.app.real_corpus.Manifest`), with its part of the split (:func:`split_of`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lockstep.streams.policy import DetectorPolicy

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
            if r == limited and rate:  # a degraded link: slow both ways
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
def busy_process(cpu: int | None, *, nice: int = -10, duty: float = 1.0):
    """A process that spins on ``cpu`` (any CPU: None) at ``nice`` (-10: a host service of raised priority; 0 where
    that is not allowed), ``duty`` of the time (it spins and sleeps in turns of 10 ms)."""

    def pin() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, nice)

    code = (
        "while True: pass"
        if duty >= 1.0
        else f"import time\nwhile True:\n    end = time.perf_counter() + {0.01 * duty!r}\n    while time.perf_counter() < end: pass\n"
        f"    time.sleep({0.01 * (1 - duty)!r})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], preexec_fn=pin)
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


def merge_connections(out: Path, world: int, dest: Path) -> bool:
    """Every rank's ``connectionsR.parquet`` as one connection table at ``dest``; False (and no file) unless every
    rank wrote one: a table missing a worker would mislead."""
    parts = [out / f"connections{r}.parquet" for r in range(world)]
    if not all(p.exists() for p in parts):
        dest.unlink(missing_ok=True)
        return False
    pq.write_table(pa.concat_tables([pq.read_table(p) for p in parts]), dest)
    return True


def diagnose_cli(out: Path, files: list[Path] | None = None, connections: Path | None = None) -> list[dict]:
    """``lockstep diagnose`` on the run's traces and samples (and connections), as a user runs it: its findings."""
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "lockstep",
            "diagnose",
            *map(str, files or traces(out)),
            "--samples",
            str(out / "samples.parquet"),
            *(["--connections", str(connections)] if connections else []),
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
    assert not blames_another(case, findings), summary(findings)


def blames_another(case: str, findings: list[dict]) -> bool:
    """Whether ``findings`` page (confidence >= 0.5) on a worker the case's fault is not on."""
    return any(f["workers"] not in ([], [EXPECT[case].worker]) and f["confidence"] >= 0.5 for f in findings)


def victims_paged(findings: list[dict], culprit: int) -> list[str]:
    """The summaries of the findings that page (confidence >= 0.5) on a worker other than ``culprit`` without its
    own work in a function it computes above its peers': a victim's waiting blamed.  A healthy rank descheduled on a
    shared machine really does more work in its own functions (its backward 2-5x its peers' in 5 of 6 short steps,
    seen in CI), which a victim never does: that is no victim paged."""
    return [
        f["summary"]
        for f in findings
        if f["workers"] not in ([], [culprit])
        and f["confidence"] >= 0.5
        and (
            f["function_kind"] in ("collective", "p2p")
            or not any(
                e["feature"] in ("work_us", f"work_us[{f['function']}]") and e["value"] > e["peer_value"]
                for e in f["evidence"]
                if e["value"] is not None and e["peer_value"] is not None
            )
        )
    ]


def summary(findings: list[dict]) -> str:
    return (
        "; ".join(f"{f['scope']} {f['workers']} {f['function']} {f['cause']} {f['confidence']:.2f}" for f in findings)
        or "no finding"
    )


# --------------------------------------------------------------------------- fixtures


META = ("worker", "step", "step_time_us", "host", "device", "hardware")


def write_fixture(
    out: Path, path: Path, min_share: float = 0.001, files: list[Path] | None = None, first_step: int = 0
) -> None:
    """The run's diagnosis inputs (function tables per worker and step, hardware mean/sd/p95 included) as one Parquet file.

    Functions below ``min_share`` of the step are left out, as the agent leaves them out of its feature batches;
    steps before ``first_step`` (warm-up steps profiled to measure the healthy step) too.
    """
    from lockstep.app.offline import load_inputs

    inputs = load_inputs(files or traces(out), None, out / "samples.parquet")
    parts = []
    for s in inputs.summaries:
        if s.step < first_step:
            continue
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
    """A fixture -> the inputs of :func:`lockstep.app.offline.diagnose` (:func:`lockstep.app.real_corpus.load_fixture`)."""
    from lockstep.app.real_corpus import load_fixture as load

    return load(path)


# --------------------------------------------------------------------------- the real-fault corpus (issue 21)

CORPUS = Path(__file__).resolve().parents[1] / "data" / "real" / "corpus"
#: the held-out part (split ``holdout``): recorded after the dev/test split had been tuned on, before any further rule
#: changed; its own folder so that scoring the corpus while developing never shows it
HOLDOUT = Path(__file__).resolve().parents[1] / "data" / "real" / "holdout"
#: steps profiled after the warm-up: one window as the detector opens it for a job of the corpus's sizes (at most
#: ``small_job_workers`` ranks: ``small_job_window_steps``, 24; the corpus was recorded with 10 before 2026-12-04)
CORPUS_STEPS = DetectorPolicy().small_job_window_steps
CORPUS_WARMUP = 4
CORPUS_HZ = 500.0
SEVERITIES = {"mild": 0.04, "strong": 0.22}  # intended cost: a share of the healthy step
HOLDOUT_SEVERITIES = {**SEVERITIES, "medium": 0.10}  # the holdout adds a severity between the two
SIZES = (2, 3, 4, 8)
#: network cases: a longer step (more compute per step), since this machine's veths and qdiscs cost ~10 ms per
#: 3 MB all-reduce at any rate they shape (measured with a TCP transfer between two namespaces)
NET_BATCH = 256
CPU_WORK = r"forward|backward|Optimizer|aten::|DataLoader"  # a rank short of CPU is slow in all its own work


@dataclass(frozen=True)
class Mechanism:
    """A way to make one rank slow: its resource class, the functions it slows (a regular expression), the causes that
    are right for it (``undetermined``: the evidence may support none), and the knobs of each severity."""

    resource: str
    function: str
    causes: tuple[str, ...]
    knobs: dict


MECHANISMS: dict[str, Mechanism] = {
    # CPU share and scheduling (made from outside)
    "cgroup_quota": Mechanism(
        "cpu",
        CPU_WORK,
        ("host_cpu_contention", "undetermined"),
        {"mild": {"quota": 0.3}, "medium": {"quota": 0.2}, "strong": {"quota": 0.1}},
    ),
    "taskset_busy": Mechanism(
        "cpu",
        CPU_WORK,
        ("host_cpu_contention", "undetermined"),
        {"mild": {"duty": 0.2}, "medium": {"duty": 0.5}, "strong": {"duty": 0.8}},
    ),
    "nice": Mechanism(
        "cpu",
        CPU_WORK,
        ("host_cpu_contention", "undetermined"),
        {"mild": {"nice": 5}, "medium": {"nice": 10}, "strong": {"nice": 19}},
    ),
    # memory
    "alloc_churn": Mechanism("memory", r"^forward$", ("host_memory", "rank_specific_code", "undetermined"), {}),
    "mmap_pageout": Mechanism("memory", r"^forward$", ("host_memory", "storage", "undetermined"), {}),
    # storage and I/O
    "checkpoint_k": Mechanism("storage", r"save_checkpoint", ("storage", "undetermined"), {}),
    "log_fsync": Mechanism("storage", r"log_metrics", ("storage", "undetermined"), {}),
    "cold_reads": Mechanism("storage", r"DataLoader|enumerate", ("storage", "dataloader", "undetermined"), {}),
    # network quality beyond bandwidth (made from outside, in namespaces; the rate follows the healthy step)
    "tbf_burst": Mechanism(
        "network",
        r"gloo:all_reduce",
        ("nic", "undetermined"),
        {
            "mild": {"rate_mbit": 8000, "burst_kb": 256, "limit_kb": 512, "batch": NET_BATCH},
            "medium": {"rate_mbit": 4000, "burst_kb": 64, "limit_kb": 128, "batch": NET_BATCH},
            "strong": {"rate_mbit": 2400, "burst_kb": 32, "limit_kb": 64, "batch": NET_BATCH},
        },
    ),
    "htb": Mechanism(
        "network",
        r"gloo:all_reduce",
        ("nic", "undetermined"),
        {
            "mild": {"rate_mbit": 8000, "burst_kb": 256, "batch": NET_BATCH},
            "medium": {"rate_mbit": 2400, "burst_kb": 128, "batch": NET_BATCH},
            "strong": {"rate_mbit": 1000, "burst_kb": 256, "batch": NET_BATCH},
        },
    ),
    "u32_path": Mechanism(
        "network",
        r"gloo:all_reduce",
        ("nic", "undetermined"),
        {
            "mild": {"rate_mbit": 8000, "burst_kb": 256, "batch": NET_BATCH},
            "medium": {"rate_mbit": 2400, "burst_kb": 128, "batch": NET_BATCH},
            "strong": {"rate_mbit": 1000, "burst_kb": 256, "batch": NET_BATCH},
        },
    ),
    # framework and software
    "extra_forward": Mechanism("software", r"^forward$", ("rank_specific_code", "undetermined"), {}),
    "hook_python": Mechanism(
        "software",
        r"DistributedDataParallel\.forward|^forward$|nn\.Module",
        ("python_overhead", "rank_specific_code", "undetermined"),
        {},
    ),
    "gc_heavy": Mechanism(
        "software",
        r"^forward$",
        ("python_overhead", "rank_specific_code", "undetermined"),
        {},
    ),
    "slow_optimizer": Mechanism("software", r"Optimizer", ("rank_specific_code", "undetermined"), {}),
    "rank_eval": Mechanism("software", r"evaluate", ("rank_specific_code", "undetermined"), {}),
    # the input pipeline
    "slow_transform": Mechanism("input", r"DataLoader|enumerate", ("dataloader", "undetermined"), {}),
}
NETWORK = ("tbf_burst", "htb", "u32_path")


@dataclass(frozen=True)
class Case:
    id: str
    mechanism: str  # a key of MECHANISMS, or "healthy"
    severity: str  # mild | strong | none
    world: int
    culprits: tuple[int, ...]
    neighbour: bool = False  # a healthy job with a noisy neighbour process on the host
    neighbour_duty: float = 0.5  # the neighbour's busy share (a busy loop on any CPU at nice 0)
    cohort: str = ""  # cases added to the corpus later, split among themselves ("": the corpus as first split)


#: jobs with two culprits (each slowed by the same mechanism): the corpus's first five
TWO_CULPRITS = (
    ("extra_forward", "strong", 4, (1, 3)),
    ("slow_optimizer", "strong", 8, (2, 6)),
    ("alloc_churn", "mild", 8, (0, 5)),
    ("nice", "strong", 8, (3, 4)),
    ("cgroup_quota", "strong", 4, (0, 2)),
)
#: ... and more, added in issue 21's ninth pass (2026-12-03) to develop the localisation of a second culprit on:
#: split like every case (:func:`split_of`), so that part of them is test data nobody tuned on
MORE_TWO_CULPRITS = (
    ("extra_forward", "mild", 8, (1, 6)),
    ("extra_forward", "strong", 3, (0, 2)),
    ("slow_optimizer", "mild", 4, (0, 3)),
    ("hook_python", "strong", 8, (2, 5)),
    ("hook_python", "mild", 4, (1, 3)),
    ("slow_transform", "strong", 3, (1, 2)),
    ("slow_transform", "mild", 8, (4, 7)),
    ("mmap_pageout", "strong", 8, (3, 7)),
    ("log_fsync", "strong", 4, (0, 1)),
    ("rank_eval", "strong", 4, (1, 3)),
    ("checkpoint_k", "mild", 4, (2, 3)),
    ("gc_heavy", "strong", 3, (0, 1)),
    ("alloc_churn", "strong", 4, (1, 2)),
    ("cgroup_quota", "mild", 8, (3, 6)),
    ("cold_reads", "strong", 4, (0, 2)),
    ("nice", "mild", 3, (1, 2)),
    ("taskset_busy", "strong", 4, (1, 2)),
)


#: a development cohort (issue 21's twelfth pass, 2026-12-03): two culprits, every mechanism made inside or beside a
#: rank (not the network's), twice (the second round at the other severity, on other job sizes and ranks), half of
#: them on 8 ranks; all ``dev`` (ids end ``-two-d``), recorded to develop the localisation of several culprits on
#: more than the dev part's ten such jobs, with the test part unchanged
def dev_two_cases() -> list[Case]:
    # rounds 1 and 2 (the twelfth pass); round 3 (the thirteenth): every one at the medium severity (~10% of the step)
    cases = []
    for round_ in range(2):
        cases += _two_culprit_cohort(
            "-two-d",
            "dev-two",
            ((8, 4, 8, 3), (4, 8, 3, 8))[round_],
            lambda i, r=round_: ("mild", "strong")[(i // 2 + r) % 2],
            ((5, 3)[round_], 1 + round_),
            ((7, 5)[round_], 2),
        )
    return cases + _two_culprit_cohort("-two-d", "dev-two", (8, 3, 8, 4), lambda i: "medium", (3, 4), (5, 3))


def _two_culprit_cohort(
    suffix: str,
    cohort: str,
    worlds: tuple[int, ...],
    severity: Callable[[int], str],
    first: tuple[int, int],
    after: tuple[int, int],
) -> list[Case]:
    """Every mechanism made inside or beside a rank (not the network's) once, as a job with two culprits: the i-th on
    ``worlds[i % len(worlds)]`` ranks at ``severity(i)``, its culprits rank a = (first[0] i + first[1]) mod world and
    the rank 1 + (after[0] i + after[1]) mod (world - 1) after a (mod world); ids ``NAME-SEVERITY-wWORLD`` + ``suffix``."""
    cases = []
    for i, name in enumerate(m for m in MECHANISMS if m not in NETWORK):
        world, sev = worlds[i % len(worlds)], severity(i)
        a = (first[0] * i + first[1]) % world
        b = (a + 1 + (after[0] * i + after[1]) % (world - 1)) % world
        cases.append(Case(f"{name}-{sev}-w{world}{suffix}", name, sev, world, tuple(sorted((a, b))), cohort=cohort))
    return cases


def corpus_cases() -> list[Case]:
    """The corpus: every mechanism at both severities on two job sizes, some with two culprits, and healthy jobs."""
    cases = []
    for i, name in enumerate(MECHANISMS):
        for j, sev in enumerate(SEVERITIES):
            world = SIZES[(i + 2 * j) % len(SIZES)]
            culprit = (3 * i + j + 1) % world
            cases.append(Case(f"{name}-{sev}-w{world}", name, sev, world, (culprit,)))
    for table, cohort in ((TWO_CULPRITS, ""), (MORE_TWO_CULPRITS, "two-culprits")):
        for name, sev, world, culprits in table:
            cases.append(Case(f"{name}-{sev}-w{world}-two", name, sev, world, culprits, cohort=cohort))
    for world in SIZES:
        cases.append(Case(f"healthy-w{world}", "healthy", "none", world, ()))
        cases.append(Case(f"healthy-neighbour-w{world}", "healthy", "none", world, (), neighbour=True))
    return cases + dev_two_cases()


def holdout_cases() -> list[Case]:
    """The held-out part, recorded after the dev/test split had been tuned on: one case per mechanism, at a job size
    neither of its dev/test cases has, at a severity cycling mild, medium (new: ~10% of the step), strong, on a culprit
    chosen afresh; and two healthy jobs with neighbours of a busy share the corpus does not have."""
    cases = []
    for i, name in enumerate(MECHANISMS):
        world = SIZES[(i + 1) % len(SIZES)] if i % 2 == 0 else SIZES[(i + 3) % len(SIZES)]
        sev = ("medium", "mild", "strong")[i % 3]
        cases.append(Case(f"{name}-{sev}-w{world}-h", name, sev, world, ((5 * i + 3) % world,)))
    cases.append(Case("healthy-neighbour70-w3-h", "healthy", "none", 3, (), neighbour=True, neighbour_duty=0.7))
    cases.append(Case("healthy-neighbour30-w4-h", "healthy", "none", 4, (), neighbour=True, neighbour_duty=0.3))
    return cases + holdout_two_cases()


def holdout_two_cases() -> list[Case]:
    """Two culprits, held out (issue 21's thirteenth pass, 2026-12-04): every mechanism made inside or beside a rank
    once, recorded after the twelfth pass's rules and never tuned on (ids end ``-two-h``, cohort ``holdout-two``): a
    check of the localisation of several culprits on jobs nobody looked at, beside ``test``'s nine.  Sizes cycle 3,
    8, 4, 8, severities medium, strong, mild; the pairs from a formula neither corpus cohort uses."""
    return _two_culprit_cohort(
        "-two-h", "holdout-two", (3, 8, 4, 8), lambda i: ("medium", "strong", "mild")[i % 3], (7, 2), (3, 1)
    )


def split_of(case_id: str, cases: list[Case]) -> str:
    """dev or test, fixed by the case ids alone: within each stratum (the mechanism, or healthy with/without a
    neighbour) the cases are ordered by a hash of their ids and alternate dev, test, dev, ... from a hash-chosen start.
    A cohort of cases added later is one stratum of its own, so that adding it moves no case of the first split."""
    import hashlib

    h = lambda x: hashlib.sha256(x.encode()).hexdigest()  # noqa: E731
    stratum = lambda c: (c.cohort,) if c.cohort else (c.mechanism, c.neighbour)  # noqa: E731
    me = next(c for c in cases if c.id == case_id)
    if me.id.endswith("-h"):
        return "holdout"
    if me.id.endswith("-d"):
        return "dev"  # the development cohort: all dev
    peers = sorted((c for c in cases if stratum(c) == stratum(me)), key=lambda c: h(c.id))
    start = int(h(me.cohort if me.cohort else f"{me.mechanism}/{me.neighbour}"), 16) % 2
    return ("dev", "test")[(peers.index(me) + start) % 2]


def _shape(kind: str, knobs: dict, world: int, rank: int, ns: str, dev: str, host_side: str) -> None:
    """Degrade one rank's link both ways (its namespace's egress and its host-side veth's egress)."""

    def tc(netns: str | None, *args: str) -> None:
        cmd = ["tc", *args] if netns is None else ["ip", "netns", "exec", netns, "tc", *args]
        subprocess.run(cmd, check=True, capture_output=True)

    rate, burst = f"{knobs['rate_mbit']}mbit", f"{knobs['burst_kb']}kb"
    peer = lambda r: f"10.231.0.{r % world + 1}/32"  # noqa: E731
    for netns, d, match in ((ns, dev, ("dst", peer(rank + 1))), (None, host_side, ("src", peer(rank - 1)))):
        if kind == "tbf_burst":  # a token bucket with small burst and queue limits: packets dropped, not queued
            limit = f"{knobs['limit_kb']}kb"
            tc(netns, "qdisc", "add", "dev", d, "root", "tbf", "rate", rate, "burst", burst, "limit", limit)
        elif kind == "htb":  # hierarchical shaping: one class at the rate, everything in it
            tc(netns, "qdisc", "add", "dev", d, "root", "handle", "1:", "htb", "default", "10")
            tc(netns, "class", "add", "dev", d, "parent", "1:", "classid", "1:10", "htb", "rate", rate, "ceil", rate,
               "burst", burst, "cburst", burst)  # fmt: skip
        elif (
            kind == "u32_path"
        ):  # a u32 filter sends one path's packets (to the next rank, from the previous) to a slow class
            tc(netns, "qdisc", "add", "dev", d, "root", "handle", "1:", "htb", "default", "20")
            tc(netns, "class", "add", "dev", d, "parent", "1:", "classid", "1:10", "htb", "rate", rate, "ceil", rate,
               "burst", burst, "cburst", burst)  # fmt: skip
            tc(netns, "class", "add", "dev", d, "parent", "1:", "classid", "1:20", "htb", "rate", "20gbit")
            tc(netns, "filter", "add", "dev", d, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
               "match", "ip", *match, "flowid", "1:10")  # fmt: skip
        else:
            raise ValueError(kind)


@contextlib.contextmanager
def _cgroup_quota(pids: list[int], quota: float):
    """Each pid in a cpu cgroup (v1) of its own, limited to ``quota`` of a CPU per 10 ms period."""
    root = Path("/sys/fs/cgroup/cpu")
    if not (root / "cpu.cfs_quota_us").exists():
        raise Unavailable("no cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    made = []
    try:
        for pid in pids:
            g = root / f"{NS_PREFIX}{os.getpid()}c{pid}"
            g.mkdir()
            made.append(g)
            (g / "cpu.cfs_period_us").write_text("10000")
            (g / "cpu.cfs_quota_us").write_text(str(int(10000 * quota)))
            (g / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        for g in made:
            for pid in (g / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (root / "cgroup.procs").write_text(pid)
            with contextlib.suppress(OSError):
                g.rmdir()


def run_case(case: Case, out: Path, *, timeout_s: float = 300.0, steps: int = 0) -> dict:
    """Run one corpus case's job; ``out`` receives the traces and samples (``steps`` after the warm-up; 0:
    :data:`CORPUS_STEPS`).  Returns the knobs used."""
    from lockstep.broker import free_port

    out.mkdir(parents=True, exist_ok=True)
    mech = MECHANISMS.get(case.mechanism)
    inside = case.mechanism if mech and not mech.knobs else "none"
    go = out / "go"
    base = [
        sys.executable, str(RANK), "--world", str(case.world), "--out", str(out), "--case", inside,
        "--culprit", ",".join(map(str, case.culprits)) or "-1", "--steps", str(steps or CORPUS_STEPS), "--hz", str(CORPUS_HZ),
        "--warmup", str(CORPUS_WARMUP), "--severity", str(HOLDOUT_SEVERITIES.get(case.severity, 0.0)), "--go", str(go),
        "--go-after-warmup", "--scratch", str(out / "scratch"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    knobs: dict = dict(mech.knobs.get(case.severity, {})) if mech else {}
    if "batch" in knobs:
        base += ["--batch", str(knobs["batch"])]
    if inside != "none":
        knobs["severity"] = HOLDOUT_SEVERITIES[case.severity]
    with contextlib.ExitStack() as stack:
        if case.mechanism in NETWORK:
            names = stack.enter_context(network(case.world, -1, ""))
            cmds = [
                ["ip", "netns", "exec", names[r], *base, "--rank", str(r), "--master", "10.231.0.1:29500", "--nic", f"eth{r}"]
                for r in range(case.world)
            ]  # fmt: skip
        else:
            master = f"127.0.0.1:{free_port()}"
            cmds = [[*base, "--rank", str(r), "--master", master, "--nic", "lo"] for r in range(case.world)]
            env["GLOO_SOCKET_IFNAME"] = "lo"
        if case.mechanism == "taskset_busy":
            cmds = [[*c, "--cpus", "1"] if r in case.culprits else c for r, c in enumerate(cmds)]
        procs = []
        try:
            for r, cmd in enumerate(cmds):
                rank_env = {**env, "GLOO_SOCKET_IFNAME": f"eth{r}"} if case.mechanism in NETWORK else env
                log = (out / f"rank{r}.log").open("wb")
                procs.append(subprocess.Popen(cmd, env=rank_env, stdout=log, stderr=subprocess.STDOUT))
                log.close()
            deadline = time.monotonic() + timeout_s
            while not all(go.with_name(f"go.rank{r}").exists() for r in range(case.world)):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(
                        f"the {case.id} job did not get ready:\n{(out / 'rank0.log').read_text()[-3000:]}"
                    )
                time.sleep(0.05)
            time.sleep(0.05)  # the files are written whole
            healthy_us = max(
                json.loads(go.with_name(f"go.rank{r}").read_text())["healthy_step_us"] for r in range(case.world)
            )
            # the fault from outside starts now, after the warm-up (its healthy step measured)
            if case.neighbour:
                stack.enter_context(busy_process(None, nice=0, duty=case.neighbour_duty))
                knobs["neighbour_duty"] = case.neighbour_duty  # on any CPU, at nice 0
            if case.mechanism == "cgroup_quota":
                stack.enter_context(_cgroup_quota([procs[c].pid for c in case.culprits], knobs["quota"]))
            elif case.mechanism == "taskset_busy":
                stack.enter_context(busy_process(1, nice=0, duty=knobs["duty"]))
                knobs["cpu"] = 1
            elif case.mechanism == "nice":  # a lower priority matters where the CPUs are contended: a busy process too
                stack.enter_context(busy_process(None, nice=0, duty=1.0))
                knobs["neighbour_duty"] = 1.0
                for c in case.culprits:
                    for tid in os.listdir(f"/proc/{procs[c].pid}/task"):
                        with contextlib.suppress(OSError):
                            os.setpriority(os.PRIO_PROCESS, int(tid), knobs["nice"])
            elif case.mechanism in NETWORK:
                pid = os.getpid()
                for c in case.culprits:
                    _shape(case.mechanism, knobs, case.world, c, names[c], f"eth{c}", f"{NS_PREFIX}h{pid}x{c}")
            knobs["healthy_step_us"] = round(healthy_us, 1)
            go.touch()
            for r, p in enumerate(procs):
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                if rc != 0:
                    raise RuntimeError(
                        f"rank {r} of {case.id} failed ({rc}):\n{(out / f'rank{r}.log').read_text()[-3000:]}"
                    )
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
                    p.wait()
    pq.write_table(
        pa.concat_tables([pq.read_table(out / f"samples{r}.parquet") for r in range(case.world)]),
        out / "samples.parquet",
    )
    return knobs


def corpus_traces(out: Path, world: int) -> list[Path]:
    return [out / f"rank{r}.json" for r in range(world)]


def record_case(case: Case, cases: list[Case], dest: Path = CORPUS, steps: int = 0) -> dict:
    """Run the case's job and write ``dest/ID.parquet`` (the fixture) and ``dest/ID.json`` (its manifest); ``steps``:
    as :func:`run_case`."""
    import datetime
    import tempfile

    from lockstep.app.real_corpus import FORMAT, Manifest, connections_path, measure, read_manifest, write_manifest

    mech = MECHANISMS.get(case.mechanism)
    old = dest / f"{case.id}.json"
    # a case keeps its part for good (a longer run of it elsewhere, ``--long``, too)
    known = next((f for f in (old, CORPUS / old.name, HOLDOUT / old.name) if f.exists()), None)
    split = read_manifest(known).split if known else split_of(case.id, cases)
    t0 = time.monotonic()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix=f"corpus-{case.id}-") as tmp:
        out = Path(tmp)
        knobs = run_case(case, out, steps=steps)
        write_fixture(out, dest / f"{case.id}.parquet", files=corpus_traces(out, case.world), first_step=CORPUS_WARMUP)
        fixture = dest / f"{case.id}.parquet"
        merge_connections(out, case.world, connections_path(fixture))
    function = mech.function if mech else ""
    manifest = Manifest(
        format=FORMAT,
        case=case.id,
        mechanism=case.mechanism,
        resource=mech.resource if mech else "none",
        severity=case.severity,
        intended_share=HOLDOUT_SEVERITIES.get(case.severity, 0.0),
        measured=measure(load_fixture(fixture), list(case.culprits), function, knobs.get("healthy_step_us", 0.0)),
        ranks=case.world,
        culprits=list(case.culprits),
        function=function,
        causes=list(mech.causes) if mech else [],
        split=split,
        neighbour=case.neighbour,
        knobs=knobs,
        fixture=fixture.name,
        recorded=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        record_seconds=round(time.monotonic() - t0, 1),
        connections=connections_path(fixture).name if connections_path(fixture).exists() else "",
        host_load=round(load, 2),
    )
    write_manifest(manifest, dest / f"{case.id}.json")
    return manifest.measured


def record_corpus(dest: Path, only: list[str], cases: list[Case] | None = None, steps: int = 0) -> int:
    """``--corpus [CASE ...]``: record the cases (all, or those named) that have no fixture yet, or those named again."""
    cases = corpus_cases() if cases is None else cases
    todo = [c for c in cases if c.id in only] if only else [c for c in cases if not (dest / f"{c.id}.json").exists()]
    unknown = set(only) - {c.id for c in cases}
    if unknown:
        raise SystemExit(f"no such corpus case: {', '.join(sorted(unknown))}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stopped: the clean-up (ranks, namespaces, cgroups) runs
    for c in sorted(todo, key=lambda c: c.world):  # the small jobs first
        t0 = time.monotonic()
        try:
            measured = record_case(c, cases, dest, steps)
        except (RuntimeError, subprocess.SubprocessError, Unavailable) as exc:
            print(f"{c.id}: FAILED {exc}", flush=True)
            continue
        print(f"{c.id}: {time.monotonic() - t0:.0f} s, {measured}", flush=True)
    return 0


#: healthy namespaced jobs' connection tables (``--healthy-links --save``): the link rules' real healthy spread
LINKS = Path(__file__).resolve().parents[1] / "data" / "real" / "links"


def healthy_links(worlds: list[int], save: Path | None = None) -> int:
    """``--healthy-links [--save] WORLD ...``: healthy jobs in network namespaces, no link shaped (how the slow-link
    bar, ``link_slow_ratio``, was chosen): each job's lowest ratio of a worker's fastest connection to the median of
    the connections it is not an end of, the figure the rule compares with the bar.  With ``--save`` each job's
    connection table is kept in :data:`LINKS` (``healthy-wN-K.connections.parquet``)."""
    import dataclasses
    import tempfile

    from lockstep.app.offline import read_connections
    from lockstep.streams.diagnosis.links import slow_links
    from lockstep.streams.policy import DiagnosisPolicy

    every = dataclasses.replace(DiagnosisPolicy(), link_slow_ratio=0.999)  # every worker's ratio, not only slow ones
    for world in worlds:
        with tempfile.TemporaryDirectory(prefix=f"healthy-links-w{world}-") as tmp:
            out = Path(tmp)
            # the network cases' job (namespaces, their batch), no culprit: nothing shaped
            run_case(Case(f"healthy-links-w{world}", "htb", "strong", world, ()), out)
            merge_connections(out, world, out / "connections.parquet")
            ratios = [x.mbps / x.others_mbps for x in slow_links(read_connections(out / "connections.parquet"), every)]
            if save is not None:
                save.mkdir(parents=True, exist_ok=True)
                k = len(list(save.glob(f"healthy-w{world}-*.connections.parquet")))
                shutil.copy(out / "connections.parquet", save / f"healthy-w{world}-{k}.connections.parquet")
        low = f"{min(ratios):.2f}" if ratios else "none below 1"
        print(f"{world} ranks: lowest ratio {low} (bar {DiagnosisPolicy().link_slow_ratio})", flush=True)
    return 0


def main(argv: list[str]) -> int:
    import tempfile

    if argv and argv[0] == "--healthy-links":
        save = LINKS if argv[1:2] == ["--save"] else None
        worlds = [int(w) for w in argv[2 if save else 1 :]]
        return healthy_links(worlds or list(SIZES[1:]), save)
    if argv and argv[0] == "--corpus":
        return record_corpus(CORPUS, argv[1:])
    if argv and argv[0] == "--holdout":
        return record_corpus(HOLDOUT, argv[1:], holdout_cases())
    if argv and argv[0] == "--long":  # --long STEPS DEST [CASE_ID ...]: every case again, in longer runs, elsewhere
        dest = Path(argv[2])
        dest.mkdir(parents=True, exist_ok=True)
        every = corpus_cases() + holdout_cases()
        return record_corpus(dest, argv[3:], every, steps=int(argv[1]))
    dest = Path(argv[0])
    for case in argv[1:] or CASES:
        with tempfile.TemporaryDirectory() as tmp:
            out = run_job(case, Path(tmp))
            write_fixture(out, dest / f"{case}.parquet")
            print(f"{case}: {summary(diagnose_cli(out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
