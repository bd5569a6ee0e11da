"""The versioned, reproducible policy: when to profile and how to judge.

A policy is a YAML file; every trigger and every finding records its id and
hash, so a finding can always be traced to the exact thresholds that produced
it.  Unknown keys and out-of-range values are rejected at load time with one
line that names the key.  :class:`PolicyFile` reloads the file when it changes;
a broken new file keeps the policy in force and logs one error.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..config import read_yaml_mapping
from ..schemas.errors import LockstepError

log = logging.getLogger("lockstep.policy")


class PolicyError(LockstepError, ValueError):
    """The policy file is unreadable or a value is out of range."""


#: the detector's slowdown rules (``detector.rule``)
RULES = ("cusum", "median")


@dataclass(frozen=True)
class DetectorPolicy:
    """Slowdown and hang detection on heartbeats, and the windows it opens (brief 2.4)."""

    baseline_steps: int = 20  # judging starts after this many steps (rule median: the baseline is a low percentile of up to 4x this many earlier steps)
    recent_steps: int = 5  # a slowdown has lasted at least this many steps, and their median step time ...
    slowdown_threshold: float = (
        0.015  # ... is at least this fraction above the baseline (the smallest slowdown worth a window)
    )
    hang_factor: float = 10.0  # no progress for this many usual step intervals is a hang ...
    hang_min_s: float = 30.0  # ... and for at least this many seconds
    window_steps: int = 8  # steps per profiling window (of a job of more than small_job_workers workers)
    # a job of at most small_job_workers workers gets windows of small_job_window_steps steps: with few peers, two
    # culprits or a noisy host need more steps than a median of many peers does (METHOD.md, "How long a window is")
    small_job_workers: int = 8
    small_job_window_steps: int = 24
    max_window_steps: int = 64  # longest window `lockstep trigger --steps` may ask for
    cooldown_steps: int = 200  # no new window for this many steps after one ended
    refused_retries: int = 2  # a window every worker refused closes at once, and its slowdown may ask again that many times without the cool-down (a "past" refusal doubles the margin each time)
    baseline_every_steps: int = 2000  # a healthy job is profiled this many steps after its last window (0: never)
    control_latency_s: float = 1.0  # control-topic latency assumed until agents have echoed a trigger
    min_margin_steps: int = 2  # start at least this many steps ahead
    max_windows_per_job: int = 1  # windows of one job open (or scheduled) at once
    max_windows_fleet: int = 50  # windows open at once in the fleet (per processor instance)
    hardware_hz: float = (
        1000.0  # hardware sampling rate during windows (NIC and process CPU at this rate; /proc at <= 100 Hz)
    )
    record_shapes: bool = False  # profiler option sent with the trigger
    with_stack: bool = False  # profiler option sent with the trigger
    # --- the detector's sensitivity; METHOD.md "How the detector decides" gives the trade-off
    rule: str = "cusum"  # cusum: change detection on log step time scaled by the job's own spread; median: the rule before (median of recent_steps vs the 25th percentile)
    reference_steps: int = (
        400  # the baseline (median, spread) is formed from up to this many steps before the current excursion
    )
    cusum_h: float = 12.0  # evidence that raises an alarm: the sum of the steps' scores (excess over the baseline, in spreads) less the allowance
    cusum_k: float = (
        0.5  # allowance per step, in spreads (plus 2/sqrt(reference size): two standard errors of its median)
    )
    step_cap: float = 3.0  # one step scores at most this many spreads (a hiccup alone cannot raise an alarm)
    spread_floor: float = 0.002  # the job's step-to-step spread (robust, of log step time) counts as at least this
    periodic_min_gap: int = 4  # a slow step that recurs at a fixed interval of at least this many steps is periodic (checkpoint, evaluation) and ignored (0: off)
    # --- incidents that end
    recovery_steps: int = 30  # a slowdown that was profiled has recovered once the median of this many steps since its window was opened is back within half the slowdown_threshold of its step time before the onset (0: never)


@dataclass(frozen=True)
class JobSelector:
    """Which jobs the detector watches: shell patterns on the job name, and tenants."""

    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    tenants: tuple[str, ...] = ()  # empty: every tenant

    def matches(self, job: str, tenant: str) -> bool:
        if self.tenants and tenant not in self.tenants:
            return False
        return any(fnmatch.fnmatchcase(job, p) for p in self.include) and not any(
            fnmatch.fnmatchcase(job, p) for p in self.exclude
        )


@dataclass(frozen=True)
class DiagnosisPolicy:
    """Peer comparison and attribution (brief 2.5)."""

    peer_group_keys: tuple[str, ...] = ("pp", "role")  # worker labels that define peer groups
    z_threshold: float = 4.0  # robust z (MAD units) above which a function's work deviates
    # a worker's own work this many standard errors (of the job's noise) above its peers' stands out (issue 21) ...
    localise_z: float = 2.5
    localise_alpha: float = 0.01  # ... and beyond what chance gives one of the window's workers this often
    localise_min_shift: float = 0.05  # ... and its own work at least this much above its peers'
    min_excess_share: float = 0.01  # ... and the excess is at least this share of the step
    rel_floor: float = 0.02  # MAD floor as a share of the median (no spread -> no division by 0)
    min_peers: int = 3  # smaller peer groups are not compared
    persistence: float = 0.5  # deviation must hold in this share of the window's steps
    min_persistent_steps: int = 2
    clock_drop: float = 0.05  # SM clock this much below peers is throttling
    throughput_drop: float = 0.2  # link throughput this much below peers is a degraded link
    cpu_other_rise: float = 0.2  # other processes taking this much more of the host CPU
    python_share_max: float = 0.01  # a Python function above this share of the step on every worker
    comm_share_max: float = 0.30  # communication above this share of the step on every worker
    # --- the diagnosis
    hardware_min_share: float = (
        0.02  # a collective's link throughput drop alone is a finding if it holds this share of the step
    )
    group_excess_share: float = 0.05  # a peer group with this share of the step more work than the other groups' median
    regression_rise: float = 0.10  # work this much above the job's earlier healthy windows ...
    history_weight: float = 0.5  # weight of the newest healthy window in the job's baseline (moving average)
    input_rise: float = 0.10  # calls or bytes this much above peers: the worker got more input
    mem_high: float = 0.90  # host memory in use above this share is pressure
    noisy_rel_mad: float = 0.10  # peers spread (1.4826 x MAD) above this share of their median: a noisy group
    small_group: int = 8  # fewer peers than this lowers the confidence
    rank_specific_present: float = 0.5  # a function run by at most this share of its peer group is rank-specific code
    # --- the diagnosis's tuning
    rank_specific_ratio: float = (
        3.0  # ... so is a CPU function taking this many times its peers' time on a healthy host
    )
    # --- the diagnosis on real signals
    link_burst_cv: float = 0.5  # a collective's links burst when their spread (sd/mean) is at least this ...
    link_steady_ratio: float = (
        0.5  # ... and one of them, with a spread below this share of its ring-mates', is saturated ...
    )
    link_min_samples: int = 5  # ... judged only on links with at least this many samples while the function ran
    ring_rate_spread: float = (
        0.5  # links of one collective whose mean rates lie within this (relative, chained) are ring-mates
    )
    ratio_peers_max: int = (
        4  # peer groups of 2 to this many workers are also compared by ratio (too few for a robust z) ...
    )
    ratio_rise: float = 0.15  # ... a worker's work this much above the slowest other worker's deviates
    # peer groups of 3 to this many workers are also read by how they split in each function (several slow ones: their
    # median is one of theirs; issue 21): the same slowest ones in more steps than chance allows (below 3: never)
    split_peers_max: int = 8
    disk_read_min_mbps: float = 1.0  # lower disk reads are storage only where the peers read at least this
    cpu_self_drop: float = (
        0.5  # CPU work that got this much less of a core than the peers', others taking as much: contention
    )
    # --- lossy links, from the workers' TCP connections (links.py)
    link_loss_min: float = 0.005  # a connection that sent this share of its data segments again is lossy ...
    link_min_retrans: int = 10  # ... and at least this many segments ...
    link_min_segs: int = 1000  # ... judged only on connections that sent at least this many in the window
    # --- slow links, from the same connections: throughput while data was in flight
    link_slow_ratio: float = 0.5  # every connection of a worker at most this share of the others' median: slow ...
    link_min_busy_us: int = 20_000  # ... judged only on connections busy this long (the kernel counts it in ticks)
    link_bulk_share: float = 0.1  # ... and that sent at least this share of the bytes of the job's busiest one


@dataclass(frozen=True)
class Policy:
    id: str = "default"
    version: int = 1
    detector: DetectorPolicy = field(default_factory=DetectorPolicy)
    diagnosis: DiagnosisPolicy = field(default_factory=DiagnosisPolicy)
    jobs: JobSelector = field(default_factory=JobSelector)

    @functools.cached_property  # frozen: computed once (every refused trigger records it)
    def hash(self) -> str:
        canon = json.dumps(asdict(self), sort_keys=True, default=list)
        return hashlib.sha256(canon.encode()).hexdigest()[:12]

    @property
    def ref(self) -> str:
        """What triggers and findings record: ``id@hash``."""
        return f"{self.id}@{self.hash}"


def _section(cls: type, data: Any, where: str) -> Any:
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise PolicyError(f"{where}: expected a mapping")
    known = {f.name: f for f in fields(cls)}
    out = {}
    for key, value in data.items():
        if key not in known:
            raise PolicyError(f"{where}.{key}: unknown key; known: {', '.join(known)}")
        default = getattr(cls(), key)
        try:
            if isinstance(default, tuple):
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise ValueError("expected a list of strings")
                value = tuple(value)
            elif isinstance(default, bool):
                if not isinstance(value, bool):
                    raise ValueError("expected true or false")
            elif isinstance(default, int):
                if isinstance(value, bool) or int(value) != value:
                    raise ValueError("expected an integer")
                value = int(value)
                if value < 0:
                    raise ValueError("must be >= 0")
            elif isinstance(default, float):
                value = float(value)
                if not value >= 0:
                    raise ValueError("must be >= 0")
            elif isinstance(default, str) and not isinstance(value, str):
                raise ValueError("expected a string")
        except (TypeError, ValueError) as exc:
            raise PolicyError(f"{where}.{key}: {value!r} is not valid: {exc}") from None
        out[key] = value
    return cls(**out)


#: (section, key, test, what the value must be): checked after loading
_RANGES = (
    ("detector", "baseline_steps", lambda v: v >= 1, ">= 1"),
    ("detector", "recent_steps", lambda v: v >= 1, ">= 1"),
    ("detector", "slowdown_threshold", lambda v: v > 0, "> 0"),
    ("detector", "hang_factor", lambda v: v > 1, "> 1"),
    ("detector", "window_steps", lambda v: 1 <= v <= 10_000, "in 1..10000"),
    ("detector", "max_window_steps", lambda v: 1 <= v <= 10_000, "in 1..10000"),
    ("detector", "small_job_workers", lambda v: v >= 0, ">= 0 (0: no job is small)"),
    ("detector", "small_job_window_steps", lambda v: 1 <= v <= 10_000, "in 1..10000"),
    ("detector", "max_windows_per_job", lambda v: v >= 1, ">= 1"),
    ("detector", "max_windows_fleet", lambda v: v >= 1, ">= 1"),
    ("detector", "hardware_hz", lambda v: 0 < v <= 10_000, "in (0, 10000]"),
    ("detector", "rule", lambda v: v in RULES, f"one of {', '.join(RULES)}"),
    ("detector", "reference_steps", lambda v: 1 <= v <= 1024, "in 1..1024"),
    ("detector", "cusum_h", lambda v: v > 0, "> 0"),
    ("detector", "step_cap", lambda v: v > 0, "> 0"),
    ("detector", "spread_floor", lambda v: 0 < v < 1, "in (0, 1)"),
    ("detector", "periodic_min_gap", lambda v: v == 0 or v >= 2, "0 (off) or >= 2"),
    ("detector", "recovery_steps", lambda v: 0 <= v <= 100_000, "0 (never) or in 1..100000"),
    ("diagnosis", "persistence", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("diagnosis", "link_steady_ratio", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("diagnosis", "link_burst_cv", lambda v: v > 0, "> 0"),
    ("diagnosis", "cpu_self_drop", lambda v: 0 < v < 1, "in (0, 1)"),
    ("diagnosis", "link_min_samples", lambda v: v >= 2, ">= 2 (a spread needs two samples)"),
    ("diagnosis", "ring_rate_spread", lambda v: v > 0, "> 0"),
    ("diagnosis", "ratio_peers_max", lambda v: v >= 2, ">= 2"),
    ("diagnosis", "ratio_rise", lambda v: v > 0, "> 0"),
    ("diagnosis", "split_peers_max", lambda v: 0 <= v <= 16, "in 0..16 (below 3: never)"),
    ("diagnosis", "localise_z", lambda v: v > 0, "> 0"),
    ("diagnosis", "localise_alpha", lambda v: 0 < v < 1, "in (0, 1)"),
    ("diagnosis", "localise_min_shift", lambda v: v >= 0, ">= 0"),
    ("diagnosis", "link_loss_min", lambda v: 0 < v < 1, "in (0, 1)"),
    ("diagnosis", "link_min_retrans", lambda v: v >= 1, ">= 1"),
    ("diagnosis", "link_min_segs", lambda v: v >= 1, ">= 1"),
    ("diagnosis", "link_slow_ratio", lambda v: 0 < v < 1, "in (0, 1)"),
    ("diagnosis", "link_min_busy_us", lambda v: v >= 1, ">= 1"),
    ("diagnosis", "link_bulk_share", lambda v: 0 <= v <= 1, "in [0, 1]"),
)


def load_policy(path: Path | str | None) -> Policy:
    if path is None:
        return Policy()
    path = Path(path)
    data = read_yaml_mapping(path, f"policy {path}", PolicyError)
    known = ("id", "version", "detector", "diagnosis", "jobs")
    unknown = set(data) - set(known)
    if unknown:
        raise PolicyError(f"policy {path}: unknown key(s) {sorted(unknown)}; known: {', '.join(known)}")
    version = data.get("version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise PolicyError(f"policy {path}: version {version!r} is not valid: expected an integer >= 1")
    policy = Policy(
        id=str(data.get("id", path.stem)),
        version=version,
        detector=_section(DetectorPolicy, data.get("detector"), f"policy {path}: detector"),
        diagnosis=_section(DiagnosisPolicy, data.get("diagnosis"), f"policy {path}: diagnosis"),
        jobs=_section(JobSelector, data.get("jobs"), f"policy {path}: jobs"),
    )
    for section, key, ok, want in _RANGES:
        value = getattr(getattr(policy, section), key)
        if not ok(value):
            raise PolicyError(f"policy {path}: {section}.{key} must be {want}, got {value!r}")
    if policy.detector.baseline_steps > policy.detector.reference_steps:
        raise PolicyError(
            f"policy {path}: detector.baseline_steps ({policy.detector.baseline_steps}) exceeds detector.reference_steps ({policy.detector.reference_steps})"
        )
    for key in ("window_steps", "small_job_window_steps"):
        if getattr(policy.detector, key) > policy.detector.max_window_steps:
            raise PolicyError(
                f"policy {path}: detector.{key} ({getattr(policy.detector, key)}) exceeds detector.max_window_steps ({policy.detector.max_window_steps})"
            )
    return policy


class PolicyFile:
    """The policy in force, reloaded from its file when the file changes (no restart).

    :meth:`check` is cheap (one ``stat``); the processor calls it from a timer.
    A new file that does not load keeps the policy in force and logs one error
    line, once per change of the file.
    """

    def __init__(self, path: Path | str | None, policy: Policy | None = None):
        self.path = Path(path) if path is not None else None
        self._sig = self._signature()
        self.policy = policy if policy is not None else load_policy(self.path)

    def _signature(self) -> tuple[int, int, int] | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def check(self) -> Policy | None:
        """The new policy if the file changed, loads and differs; ``None`` otherwise."""
        sig = self._signature()
        if self.path is None or sig == self._sig:
            return None
        self._sig = sig
        try:
            new = load_policy(self.path)
        except PolicyError as exc:
            log.error("%s; keeping policy %s", exc, self.policy.ref)
            return None
        if new.ref == self.policy.ref:
            return None
        log.info("policy reloaded from %s: %s -> %s", self.path, self.policy.ref, new.ref)
        self.policy = new
        return new
