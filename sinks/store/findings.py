"""FindingsStore: the sink's read-write handle on the findings file (writes, incidents, queries through it)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

import duckdb
import msgspec
import pyarrow as pa

from ...schemas.records import Finding
from ..paging.incidents import (
    Event,
    Incident,
    IncidentPolicy,
    JobNews,
    ReportedWindow,
    acknowledge,
    incident_key,
    on_clock,
    on_finding,
    on_job_news,
    on_window,
    resolve_by_hand,
)
from . import migrations
from .reads import QUERY_LIMITS, QueryBusy, QueryLimits, StoreError, StoreLocked, duckdb_config, one, run_query
from .writes import (
    EVENT_SCHEMA,
    INCIDENT_SCHEMA,
    INCIDENT_SELECT,
    INCIDENT_TIMES,
    SLOWDOWN_NEWS_FIRST,
    SLOWDOWN_NEWS_OF_TRIGGER,
    Batch,
    changes_table,
    deviations_table,
    epoch_us,
    findings_table,
    incident_select,
    registered,
    series_table,
    transaction,
    triggers_table,
    upsert,
    windows_table,
)

log = logging.getLogger("lockstep.sinks.store")


class UnknownIncident(StoreError, LookupError):
    """No incident of that id (for that tenant)."""


@dataclasses.dataclass(frozen=True)
class Pruned:
    """Rows :meth:`FindingsStore.prune` deleted, by table."""

    findings: int = 0
    windows: int = 0
    triggers: int = 0
    window_deviations: int = 0
    step_series: int = 0
    job_changes: int = 0
    incidents: int = 0
    incident_events: int = 0
    webhook_deliveries: int = 0

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))


#: what prune never deletes: rows an open incident still needs (its findings: the pager's resolve reads the last
#: one; its first window and trigger; its job's news, which may end it), the last incident event (its ``seq`` numbers
#: the next one: the pager's cursor and the deliveries' ids must never see a number again), events the pager has not
#: planned yet and deliveries still pending.  ``?`` is the bound (epoch seconds).
PRUNE = (
    (
        "findings",
        """DELETE FROM findings WHERE epoch(created_at) < ?
           AND id NOT IN (SELECT first_finding FROM _open UNION ALL SELECT last_finding FROM _open)
           AND coalesce(incident_id, '') NOT IN (SELECT id FROM _open)""",
    ),
    (
        "window_deviations",
        """DELETE FROM window_deviations d USING windows w
           WHERE w.job = d.job AND w.window_id = d.window_id AND epoch(w.closed_at) < ?
             AND (d.job, d.window_id) NOT IN (SELECT job, first_window FROM _open)""",
    ),
    (
        "windows",
        """DELETE FROM windows WHERE epoch(closed_at) < ?
           AND (job, window_id) NOT IN (SELECT job, first_window FROM _open)""",
    ),
    (
        "triggers",
        """DELETE FROM triggers WHERE epoch(created_at) < ?
           AND (job, window_id) NOT IN (SELECT job, first_window FROM _open)""",
    ),
    ("step_series", "DELETE FROM step_series WHERE epoch(received_at) < ?"),
    (
        "job_changes",
        "DELETE FROM job_changes WHERE epoch(changed_at) < ? AND job NOT IN (SELECT job FROM _open)",
    ),
    ("incidents", "DELETE FROM incidents WHERE status = 'resolved' AND epoch(resolved_at) < ?"),
    (
        "incident_events",
        """DELETE FROM incident_events WHERE epoch(occurred_at) < ?
           AND incident_id NOT IN (SELECT id FROM _open)
           AND seq < (SELECT max(seq) FROM incident_events)
           AND seq <= coalesce((SELECT min(last_seq) FROM pager_cursor), (SELECT max(seq) FROM incident_events))""",
    ),
    ("webhook_deliveries", "DELETE FROM webhook_deliveries WHERE epoch(created_at) < ? AND status <> 'pending'"),
)


class FindingsStore:
    """The read-write owner of the DuckDB file (the sink)."""

    def __init__(
        self,
        path: Path | str,
        policy: IncidentPolicy | None = None,
        limits: QueryLimits = QUERY_LIMITS,
        series_keep_steps: int = 20_000,
    ):
        self.path = Path(path)
        self.policy = policy or IncidentPolicy()
        self.limits = limits
        self.series_keep_steps = series_keep_steps
        self._slots = threading.BoundedSemaphore(limits.concurrent)
        self._running: set[duckdb.DuckDBPyConnection] = set()
        self._closing = False
        #: the Kafka topic ids of the topics being read (the sink sets them when assigned); stored with the offsets
        self.topic_ids: dict[str, str] = {}
        try:
            self.con = duckdb.connect(str(self.path), config=duckdb_config(limits))
        except duckdb.IOException as exc:
            if "lock" in str(exc).lower():
                raise StoreLocked(f"{self.path} is held by another process (is a sink already running?)") from None
            raise StoreError(f"cannot open {self.path}: {exc}") from None
        self.migrate()

    def migrate(self) -> int:
        """The file at the latest schema version (:func:`.migrations.migrate`); migration 2 builds the incidents."""
        return migrations.migrate(self.con, self.path, data={2: self._backfill_incidents})

    def offsets(self) -> dict[tuple[str, int], int]:
        return {
            (t, p): o
            for t, p, o in self.con.execute('SELECT topic, "partition", next_offset FROM sink_offsets').fetchall()
        }

    def stored_offsets(self) -> dict[tuple[str, int], tuple[int, str | None]]:
        """(topic, partition) -> (next offset, the topic's Kafka id when it was stored; None: not known)."""
        return {
            (t, p): (o, tid)
            for t, p, o, tid in self.con.execute(
                'SELECT topic, "partition", next_offset, topic_id FROM sink_offsets'
            ).fetchall()
        }

    def write(self, batch: Batch, now: float | None = None) -> list[Event]:
        """Upsert findings, windows and triggers, keep the incidents, record offsets: one transaction.

        Returns the incident events it appended (the pager's input).  Queries share the instance's memory
        bound: when they hold it, the transaction is tried again until the longest query's time is up."""
        deadline = time.monotonic() + self.limits.timeout_s
        while True:
            try:
                return self._write(batch, now)
            except duckdb.OutOfMemoryException:
                if time.monotonic() >= deadline:
                    raise
                log.warning("the findings store is out of memory (queries hold it); writing again in 0.5 s")
                time.sleep(0.5)

    def _write(self, batch: Batch, now: float | None) -> list[Event]:
        now = time.time() if now is None else now
        con = self.con
        # the same key twice in one statement is an error for ON CONFLICT: the last one wins
        findings = list({f.id: f for f in batch.findings}.values())
        windows = list({(w.job, w.window): w for w in batch.windows}.values())
        triggers = list({(t.job, t.window): t for t in batch.triggers}.values())
        with transaction(con):
            known = set()
            if findings:
                ids = [f.id for f in findings]
                known = {
                    r[0] for r in con.execute("SELECT id FROM findings WHERE list_contains(?, id)", [ids]).fetchall()
                }
            incidents, events, incident_ids = self._on_findings([f for f in findings if f.id not in known])
            if findings:
                upsert(
                    con,
                    "findings",
                    findings_table(findings, now, incident_ids),
                    ("id",),
                    keep=("first_seen", "incident_id"),
                )
            if windows:
                upsert(con, "windows", windows_table(windows), ("job", "window_id"))
            if triggers:
                upsert(con, "triggers", triggers_table(triggers), ("job", "window_id"))
            if batch.series:
                upsert(con, "step_series", series_table(batch.series, now), ("job", "step"))
            if batch.changes:
                changes = list({(c.job, c.change, c.step, c.window): c for c in batch.changes}.values())
                upsert(con, "job_changes", changes_table(changes), ("job", "change", "step", "window_id"))
            if batch.maps:
                maps = list({(d.job, d.window): d for d in batch.maps}.values())
                with registered(
                    con, "_done", pa.table({"job": [d.job for d in maps], "window_id": [d.window for d in maps]})
                ):
                    con.execute(
                        "DELETE FROM window_deviations USING _done d WHERE window_deviations.job = d.job AND window_deviations.window_id = d.window_id"
                    )
                with registered(con, "_rows", deviations_table(maps)):
                    con.execute("INSERT INTO window_deviations SELECT * FROM _rows")
            if batch.offsets:
                offsets = {
                    "topic": [t for t, _ in batch.offsets],
                    "partition": pa.array([p for _, p in batch.offsets], pa.int32()),
                    "next_offset": list(batch.offsets.values()),
                    "topic_id": pa.array([self.topic_ids.get(t) for t, _ in batch.offsets], pa.string()),
                }
                upsert(con, "sink_offsets", pa.table(offsets), ("topic", "partition"))
            self._triggered_at(incidents)
            events += self._on_windows(incidents)
            events += self._on_job_news(incidents, {c.job for c in batch.changes})
            self._save(incidents, events)
            if incidents or batch.changes:
                self._onsets()
        return events

    def expire(self, now: float | None = None) -> list[Event]:
        """Resolve open incidents that no window has seen for ``policy.stale_after_s`` (one transaction)."""
        now = time.time() if now is None else now
        con = self.con
        with transaction(con):
            stale = self._incidents("status = 'open' AND epoch(last_seen_at) <= ?", [now - self.policy.stale_after_s])
            changes = on_clock(stale, now, self.policy)
            incidents = {inc.id: inc for inc, _ in changes}
            events = [ev for _, ev in changes]
            self._save(incidents, events)
            # each job's step-time series keeps its last series_keep_steps steps
            con.execute(
                "DELETE FROM step_series s USING (SELECT job, max(step) AS last FROM step_series GROUP BY job) l "
                "WHERE s.job = l.job AND s.step <= l.last - ?",
                [self.series_keep_steps],
            )
        return events

    def incident(self, incident_id: str, tenant: str | None = None) -> Incident:
        """One incident (of ``tenant`` when given), or :class:`UnknownIncident`."""
        found = self._incidents(
            "id = ?" + (" AND tenant = ?" if tenant is not None else ""),
            [incident_id] + ([tenant] if tenant is not None else []),
        )
        if not found:
            raise UnknownIncident(
                f"no incident {incident_id!r}"
                + (f" of tenant {tenant!r}" if tenant is not None else "")
                + ' (lockstep query "SELECT id, job, cause, status FROM incidents" lists them)'
            )
        return found[0]

    def acknowledge(
        self, incident_id: str, by: str, tenant: str | None = None, now: float | None = None
    ) -> tuple[Incident, list[Event]]:
        """Someone acknowledged an open incident (:func:`..paging.incidents.acknowledge`); one transaction.  Returns the
        incident as stored and the event appended (none when it was acknowledged already)."""
        return self._by_hand(acknowledge, incident_id, by, tenant, now)

    def resolve(
        self, incident_id: str, by: str, tenant: str | None = None, now: float | None = None
    ) -> tuple[Incident, list[Event]]:
        """Someone resolved an open incident (:func:`..paging.incidents.resolve_by_hand`); one transaction."""
        return self._by_hand(resolve_by_hand, incident_id, by, tenant, now)

    def _by_hand(self, change, incident_id: str, by: str, tenant: str | None, now: float | None):
        now = time.time() if now is None else now
        with transaction(self.con):
            inc, ev = change(self.incident(incident_id, tenant), by, now)
            events = [ev] if ev is not None else []
            if events:
                self._save({inc.id: inc}, events)
        if events:
            log.info("incident %s: %s by %s", inc.id, events[0].action, by)
        return inc, events

    def prune(self, older_than_s: float, now: float | None = None) -> Pruned:
        """Delete what is older than ``older_than_s`` (findings, windows, triggers, heatmaps, step series, the
        detector's news, resolved incidents and their events, finished deliveries), except what open incidents and
        the pager still need (:data:`PRUNE`); one transaction.  DuckDB reuses the space; the file does not shrink."""
        if not older_than_s > 0:
            raise StoreError(f"prune: the age bound must be positive, not {older_than_s}")
        now = time.time() if now is None else now
        before = now - older_than_s
        counts = {}
        with transaction(self.con):
            self.con.execute(
                "CREATE OR REPLACE TEMP TABLE _open AS SELECT id, job, coalesce(first_window, '') AS first_window, "
                "coalesce(first_finding, '') AS first_finding, coalesce(last_finding, '') AS last_finding "
                "FROM incidents WHERE status = 'open'"
            )
            try:
                for table, sql in PRUNE:
                    counts[table] = one(self.con.execute(sql, [before]).fetchone(), f"rows deleted from {table}")[0]
            finally:
                self.con.execute("DROP TABLE _open")
        pruned = Pruned(**counts)
        if pruned.total:
            log.info("pruned %d row(s) older than %.0f s: %s", pruned.total, older_than_s, dataclasses.asdict(pruned))
        return pruned

    # -------------------------------------------------------------- incidents (inside the caller's transaction)

    def _incident_columns(self) -> list[str]:
        """The incidents columns this file has of INCIDENT_SCHEMA's (a migration's data step runs before later
        migrations added theirs)."""
        have = {
            r[0]
            for r in self.con.execute(
                "SELECT column_name FROM duckdb_columns() WHERE table_name = 'incidents' AND database_name = current_database()"
            ).fetchall()
        }
        return [c for c in INCIDENT_SCHEMA.names if c in have]

    def _incidents(self, where: str, params: list) -> list[Incident]:
        cols = self._incident_columns()
        select = INCIDENT_SELECT if len(cols) == len(INCIDENT_SCHEMA.names) else incident_select(cols)
        cur = self.con.execute(f"SELECT {select} FROM incidents WHERE {where}", params)
        cols = [d[0] for d in cur.description]
        return [Incident(**dict(zip(cols, r))) for r in cur.fetchall()]

    def _open_incidents(self, jobs: list[str], incidents: dict[str, Incident]) -> dict[str, Incident]:
        """The open incidents of ``jobs`` by id, as stored, with this transaction's changes over them (they are newer)."""
        state = {inc.id: inc for inc in self._incidents("status = 'open' AND list_contains(?, job)", [jobs])}
        state.update(incidents)
        return state

    def _on_findings(self, new: list[Finding]) -> tuple[dict[str, Incident], list[Event], dict[str, str]]:
        """Apply findings never stored before to the latest occurrence of their incident."""
        if not new:
            return {}, [], {}
        new.sort(key=lambda f: (f.created_at, min(f.steps, default=0)))
        keys = sorted({incident_key(f) for f in new})
        latest = {
            inc.key: inc
            for inc in self._incidents(
                "list_contains(?, key) QUALIFY row_number() OVER (PARTITION BY key ORDER BY occurrence DESC) = 1",
                [keys],
            )
        }
        changed: dict[str, Incident] = {}
        events: list[Event] = []
        incident_ids: dict[str, str] = {}
        for f in new:
            key = incident_key(f)
            inc, ev = on_finding(latest.get(key), f)
            incident_ids[f.id] = inc.id
            if ev is not None:
                latest[key] = changed[inc.id] = inc
                events.append(ev)
        return changed, events, incident_ids

    def _on_windows(self, incidents: dict[str, Incident]) -> list[Event]:
        """Resolve, for every window whose findings are all stored, the open incidents it did not see.

        A window counts once all of its findings are in (``windows.findings``), or once all of a later window's are
        (the job's findings share one partition, in window order: a later window's in means this one's are): findings
        and window reports travel on different topics and may arrive in either order.  A later window's report alone
        is no such evidence (a sink restarted mid-stream stored it before the earlier window's findings, which then
        resolved and reopened 200 incidents).
        """
        rows = self.con.execute(
            """
            SELECT tenant, job, window_id, start_step,
                   -- a failed window cannot clear a problem: what it lost may be what it would have seen
                   CASE WHEN closed = 'failed' THEN 0.0 ELSE coverage END, epoch(closed_at) FROM windows w
            WHERE NOT coalesce(incidents_checked, false) AND (
                (SELECT count(*) FROM findings f WHERE f.job = w.job AND f.window_id = w.window_id) >= w.findings
                OR EXISTS (SELECT 1 FROM windows l WHERE l.job = w.job AND l.start_step > w.start_step AND l.findings > 0
                           AND (SELECT count(*) FROM findings f WHERE f.job = l.job AND f.window_id = l.window_id)
                               >= l.findings))
            ORDER BY start_step
            """
        ).fetchall()
        if not rows:
            return []
        closed = [ReportedWindow(*r) for r in rows]
        jobs = sorted({w.job for w in closed})
        state = self._open_incidents(jobs, incidents)
        events = []
        for w in closed:
            for inc, ev in on_window([i for i in state.values() if i.job == w.job], w, self.policy):
                state[inc.id] = incidents[inc.id] = inc
                events.append(ev)
        done = pa.table({"job": [w.job for w in closed], "window_id": [w.window for w in closed]})
        with registered(self.con, "_done", done):
            self.con.execute(
                "UPDATE windows SET incidents_checked = true FROM _done d WHERE windows.job = d.job AND windows.window_id = d.window_id"
            )
        return events

    def _triggered_at(self, incidents: dict[str, Incident]) -> None:
        """New incidents learn when their first window was triggered (the triggers table)."""
        todo = [i for i in incidents.values() if i.first_trigger_at is None and i.first_window]
        if not todo:
            return
        rows = self.con.execute(
            "SELECT job, window_id, epoch(created_at) FROM triggers WHERE list_contains(?, job) AND list_contains(?, window_id)",
            [sorted({i.job for i in todo}), sorted({i.first_window for i in todo})],
        ).fetchall()
        at = {(j, w): t for j, w, t in rows}
        for inc in todo:
            if (t := at.get((inc.job, inc.first_window))) is not None:
                incidents[inc.id] = dataclasses.replace(inc, first_trigger_at=t)

    def _on_job_news(self, incidents: dict[str, Incident], jobs: set[str]) -> list[Event]:
        """Resolve the open incidents that the detector's news (a job ended, a slowdown recovered) ends: those of the
        jobs with news in this transaction, and this transaction's open incidents (their finding may come after the
        news: findings and the detector's news travel on different topics)."""
        jobs = jobs | {i.job for i in incidents.values() if i.status == "open"}
        if not jobs:
            return []
        rows = self.con.execute(
            "SELECT tenant, job, change, step, coalesce(onset_step, 0), epoch(changed_at), coalesce(after_s, 0) FROM job_changes "
            "WHERE list_contains(?, job) AND change IN ('ended', 'recovered')",
            [sorted(jobs)],
        ).fetchall()
        if not rows:
            return []
        news = [JobNews(*r) for r in rows]
        with_news = sorted({n.job for n in news})
        state = self._open_incidents(with_news, incidents)
        changes = on_job_news([i for i in state.values() if i.job in with_news], news)
        for inc, _ in changes:
            incidents[inc.id] = inc
        return [ev for _, ev in changes]

    def _onsets(self) -> None:
        """Incidents whose first window the detector opened for a slowdown keep its onset and step times before and
        during (the ``slowdown`` news, whichever of it and the finding came first)."""
        self.con.execute(
            """
            UPDATE incidents SET onset_step = c.onset_step, onset_at = c.onset_at, before_s = c.before_s,
                                 during_s = c.during_s
            FROM job_changes c
            WHERE c.change = 'slowdown' AND c.job = incidents.job AND c.window_id = incidents.first_window
              AND incidents.onset_at IS NULL
            """
        )
        # first seen in a window asked again for the same slowdown (every worker refused the one before): no news
        # names it, the slowdown's news names the refused window
        self.con.execute(
            f"""
            UPDATE incidents SET onset_step = n.onset_step, onset_at = n.onset_at, before_s = n.before_s,
                                 during_s = n.during_s
            FROM (
                SELECT i.id, c.onset_step, c.onset_at, c.before_s, c.during_s
                FROM incidents i JOIN triggers t ON t.job = i.job AND t.window_id = i.first_window
                JOIN job_changes c ON {SLOWDOWN_NEWS_OF_TRIGGER}
                WHERE i.onset_at IS NULL AND t.kind = 'slowdown'
                QUALIFY row_number() OVER (PARTITION BY i.id ORDER BY {SLOWDOWN_NEWS_FIRST}) = 1
            ) n
            WHERE incidents.id = n.id
            """
        )

    def _save(self, incidents: dict[str, Incident], events: list[Event]) -> None:
        con = self.con
        if incidents:
            rows = [
                dataclasses.asdict(i) | {c: epoch_us(getattr(i, c)) for c in INCIDENT_TIMES} for i in incidents.values()
            ]
            table = pa.Table.from_pylist(rows, schema=INCIDENT_SCHEMA)
            cols = self._incident_columns()
            upsert(con, "incidents", table.select(cols) if len(cols) < table.num_columns else table, ("id",))
        if events:
            seq = one(con.execute("SELECT coalesce(max(seq), 0) FROM incident_events").fetchone(), "the last event")[0]
            rows = [
                dataclasses.asdict(e) | {"seq": seq + i + 1, "occurred_at": epoch_us(e.occurred_at)}
                for i, e in enumerate(events)
            ]
            upsert(con, "incident_events", pa.Table.from_pylist(rows, schema=EVENT_SCHEMA), ("seq",))

    def _backfill_incidents(self) -> None:
        """Migration 2: build the incidents of an existing file from its findings and windows, without events.

        All findings first (in time order), then every window (in step order)."""
        dec = msgspec.json.Decoder(Finding)
        records = [dec.decode(r[0]) for r in self.con.execute("SELECT record FROM findings").fetchall()]
        incidents, _, incident_ids = self._on_findings(records)
        self._on_windows(incidents)
        if incident_ids:
            ids = pa.table({"id": list(incident_ids), "incident_id": list(incident_ids.values())})
            with registered(self.con, "_ids", ids):
                self.con.execute("UPDATE findings SET incident_id = i.incident_id FROM _ids i WHERE findings.id = i.id")
        self._save(incidents, [])

    def query(self, sql: str, params: list | None = None, tenant: str | None = None) -> tuple[list[str], list[tuple]]:
        """Someone's read-only SQL, on a connection of its own, within :attr:`limits` (:func:`run_query`).

        Raises QueryBusy when ``limits.concurrent`` queries are running already, StoreError when the SQL is
        not allowed or breaks a limit."""
        if self._closing:
            raise QueryBusy("the sink is stopping")
        if not self._slots.acquire(timeout=1.0):
            raise QueryBusy(
                f"{self.limits.concurrent} queries are running, the most the sink runs at once; ask again in a moment"
            )
        try:
            cur = self.con.cursor()
            self._running.add(cur)
            try:
                return run_query(cur, sql, params, tenant, self.limits)
            finally:
                self._running.discard(cur)
                cur.close()
        finally:
            self._slots.release()

    def close(self) -> None:
        """Interrupt the queries that run (a query must not hold up a shutdown), wait for them to end, close."""
        self._closing = True
        for cur in list(self._running):
            cur.interrupt()
        for _ in range(self.limits.concurrent):
            self._slots.acquire(timeout=self.limits.timeout_s)
        self.con.close()
