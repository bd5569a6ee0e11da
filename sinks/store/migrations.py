"""The findings file's schema: versioned migrations, each applied once in its own transaction.

The tables and views are listed in docs/store.md ("Tables and views").  SQL names follow the records, except where
SQL reserves the word: ``Finding.window`` is the column ``window_id`` and ``Finding.group`` is ``peer_group``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import duckdb

from .reads import StoreError
from .writes import transaction

log = logging.getLogger("lockstep.sinks.store")

MIGRATIONS: list[tuple[int, str, str]] = [
    (
        1,
        "findings, windows and sink offsets",
        """
        CREATE TABLE findings (
            id VARCHAR PRIMARY KEY,
            job VARCHAR NOT NULL,
            tenant VARCHAR NOT NULL,
            window_id VARCHAR NOT NULL,
            steps INTEGER[],
            window_steps INTEGER,
            scope VARCHAR NOT NULL,
            workers INTEGER[],
            hosts VARCHAR[],
            devices VARCHAR[],
            peer_group MAP(VARCHAR, VARCHAR),
            function VARCHAR,
            function_kind VARCHAR,
            cause VARCHAR NOT NULL,
            confidence DOUBLE,
            evidence JSON,
            step_time_share DOUBLE,
            gpu_hours_per_day DOUBLE,
            policy VARCHAR,
            summary VARCHAR,
            created_at TIMESTAMP,
            record JSON,
            first_seen TIMESTAMP,
            updated_at TIMESTAMP
        );
        CREATE TABLE windows (
            job VARCHAR NOT NULL,
            window_id VARCHAR NOT NULL,
            tenant VARCHAR NOT NULL,
            start_step BIGINT,
            steps INTEGER,
            steps_seen INTEGER,
            expected_workers INTEGER,
            workers_seen INTEGER,
            coverage DOUBLE,
            bytes_per_worker DOUBLE,
            findings INTEGER,
            actionable BOOLEAN,
            reached_device BOOLEAN,
            closed VARCHAR,
            closed_at TIMESTAMP,
            policy VARCHAR,
            PRIMARY KEY (job, window_id)
        );
        CREATE TABLE sink_offsets (
            topic VARCHAR NOT NULL,
            "partition" INTEGER NOT NULL,
            next_offset BIGINT NOT NULL,
            PRIMARY KEY (topic, "partition")
        );
        """,
    ),
    (
        2,
        "triggers, incidents, webhook deliveries, profiling overhead, views",
        """
        ALTER TABLE findings ADD COLUMN incident_id VARCHAR;
        ALTER TABLE windows ADD COLUMN profiling_overhead DOUBLE;
        ALTER TABLE windows ADD COLUMN incidents_checked BOOLEAN DEFAULT false;
        CREATE TABLE triggers (
            job VARCHAR NOT NULL,
            window_id VARCHAR NOT NULL,
            tenant VARCHAR NOT NULL,
            start_step BIGINT,
            steps INTEGER,
            expected_workers INTEGER,
            policy VARCHAR,
            reason VARCHAR,
            hardware_hz DOUBLE,
            record_shapes BOOLEAN,
            with_stack BOOLEAN,
            created_at TIMESTAMP,
            PRIMARY KEY (job, window_id)
        );
        CREATE TABLE incidents (
            id VARCHAR PRIMARY KEY,
            key VARCHAR NOT NULL,
            occurrence INTEGER NOT NULL,
            tenant VARCHAR NOT NULL,
            job VARCHAR NOT NULL,
            scope VARCHAR,
            cause VARCHAR,
            function VARCHAR,
            workers INTEGER[],
            hosts VARCHAR[],
            devices VARCHAR[],
            status VARCHAR NOT NULL,
            opened_at TIMESTAMP,
            last_seen_at TIMESTAMP,
            resolved_at TIMESTAMP,
            resolved_by VARCHAR,
            resolved_step BIGINT,
            first_finding VARCHAR,
            last_finding VARCHAR,
            last_step BIGINT,
            windows INTEGER,
            confidence DOUBLE,
            step_time_share DOUBLE,
            gpu_hours_per_day DOUBLE
        );
        CREATE TABLE incident_events (
            seq BIGINT PRIMARY KEY,
            incident_id VARCHAR NOT NULL,
            tenant VARCHAR NOT NULL,
            job VARCHAR NOT NULL,
            action VARCHAR NOT NULL,
            finding_id VARCHAR,
            reason VARCHAR,
            occurred_at TIMESTAMP
        );
        CREATE TABLE webhook_deliveries (
            id VARCHAR PRIMARY KEY,
            event_seq BIGINT NOT NULL,
            route VARCHAR NOT NULL,
            receiver VARCHAR NOT NULL,
            action VARCHAR NOT NULL,
            incident_id VARCHAR NOT NULL,
            tenant VARCHAR NOT NULL,
            job VARCHAR NOT NULL,
            severity VARCHAR,
            status VARCHAR NOT NULL,
            attempts INTEGER NOT NULL DEFAULT 0,
            next_attempt_at TIMESTAMP,
            last_status INTEGER,
            last_error VARCHAR,
            created_at TIMESTAMP,
            delivered_at TIMESTAMP,
            payload JSON
        );
        CREATE TABLE pager_cursor (
            name VARCHAR PRIMARY KEY,
            last_seq BIGINT NOT NULL
        );
        CREATE VIEW open_findings AS
            SELECT f.*, i.opened_at, i.windows AS windows_seen, i.occurrence
            FROM incidents i JOIN findings f ON f.id = i.last_finding
            WHERE i.status = 'open';
        CREATE VIEW top_culprits AS
            WITH named AS (
                SELECT tenant, job, incident_id, cause, created_at, hosts,
                       unnest(CASE WHEN len(devices) > 0 THEN devices ELSE [NULL::VARCHAR] END) AS device
                FROM findings WHERE scope <> 'job'
            ), per_incident AS (
                SELECT tenant,
                       CASE WHEN len(hosts) = 1 THEN hosts[1]
                            ELSE list_filter(hosts, lambda h: starts_with(device, h || '/'))[1] END AS host,
                       device, incident_id, any_value(job) AS job, any_value(cause) AS cause,
                       count(*) AS findings, max(created_at) AS last_seen
                FROM named GROUP BY ALL
            )
            SELECT p.tenant, p.host, p.device, count(*) AS incidents,
                   count(*) FILTER (WHERE i.status = 'open') AS open_incidents,
                   sum(p.findings) AS findings,
                   list(DISTINCT p.cause ORDER BY p.cause) AS causes,
                   list(DISTINCT p.job ORDER BY p.job) AS jobs,
                   coalesce(sum(i.gpu_hours_per_day) FILTER (WHERE i.status = 'open'), 0) AS gpu_hours_per_day,
                   max(p.last_seen) AS last_seen
            FROM per_incident p LEFT JOIN incidents i ON i.id = p.incident_id
            GROUP BY p.tenant, p.host, p.device;
        CREATE VIEW gpu_hours_lost_by_cause AS
            SELECT tenant, cause, count(*) AS incidents,
                   count(*) FILTER (WHERE status = 'open') AS open_incidents,
                   coalesce(sum(gpu_hours_per_day) FILTER (WHERE status = 'open'), 0) AS gpu_hours_per_day,
                   sum(gpu_hours_per_day * epoch(coalesce(resolved_at, timezone('UTC', now())) - opened_at) / 86400) AS gpu_hours_lost
            FROM incidents GROUP BY tenant, cause;
        CREATE VIEW coverage_by_job AS
            SELECT tenant, job, count(*) AS windows,
                   avg(coverage) AS mean_coverage, min(coverage) AS min_coverage,
                   avg(bytes_per_worker) AS mean_bytes_per_worker,
                   avg(profiling_overhead) AS mean_profiling_overhead,
                   avg(reached_device::INTEGER) AS reached_device_share,
                   count(*) FILTER (WHERE closed = 'timeout') AS timed_out,
                   max(closed_at) AS last_closed_at
            FROM windows GROUP BY tenant, job;
        CREATE VIEW actionable_share AS
            SELECT tenant, job, count(*) AS windows,
                   count(*) FILTER (WHERE actionable) AS actionable_windows,
                   avg(actionable::INTEGER) AS actionable_share
            FROM windows GROUP BY tenant, job;
        """,
    ),
    (
        3,
        "triggers.kind: what opened each window (slowdown, hang, manual, baseline)",
        """
        ALTER TABLE triggers ADD COLUMN kind VARCHAR;
        UPDATE triggers SET kind = nullif(regexp_extract(reason, '^(slowdown|hang|manual|baseline)', 1), '');
        """,
    ),
    (
        4,
        "step_series (per-job step times) and window_deviations (per-window heatmaps), for the pictures",
        """
        CREATE TABLE step_series (
            job VARCHAR NOT NULL,
            tenant VARCHAR NOT NULL,
            step BIGINT NOT NULL,
            step_time_us DOUBLE,
            median_us DOUBLE,
            workers INTEGER,
            received_at TIMESTAMP,
            PRIMARY KEY (job, step)
        );
        CREATE TABLE window_deviations (
            job VARCHAR NOT NULL,
            window_id VARCHAR NOT NULL,
            tenant VARCHAR NOT NULL,
            worker INTEGER NOT NULL,
            function VARCHAR NOT NULL,
            worker_rank INTEGER,
            function_rank INTEGER,
            z DOUBLE,
            flagged_steps INTEGER,
            workers_total INTEGER,
            functions_total INTEGER,
            PRIMARY KEY (job, window_id, worker, function)
        );
        """,
    ),
    (
        5,
        "incidents that end: job_changes (the detector's slowdowns, recoveries, job ends), incidents' onset, "
        "resolution reason and step times, views incident_timeline and incident_outcomes",
        """
        CREATE TABLE job_changes (
            job VARCHAR NOT NULL,
            tenant VARCHAR NOT NULL,
            change VARCHAR NOT NULL,
            step BIGINT NOT NULL,
            window_id VARCHAR NOT NULL,
            onset_step BIGINT,
            onset_at TIMESTAMP,
            before_s DOUBLE,
            during_s DOUBLE,
            after_s DOUBLE,
            steps INTEGER,
            job_end VARCHAR,
            reason VARCHAR,
            changed_at TIMESTAMP,
            PRIMARY KEY (job, change, step, window_id)
        );
        ALTER TABLE incidents ADD COLUMN first_window VARCHAR;
        ALTER TABLE incidents ADD COLUMN first_step BIGINT;
        ALTER TABLE incidents ADD COLUMN first_trigger_at TIMESTAMP;
        ALTER TABLE incidents ADD COLUMN resolved_reason VARCHAR;
        ALTER TABLE incidents ADD COLUMN after_s DOUBLE;
        ALTER TABLE incidents ADD COLUMN onset_step BIGINT;
        ALTER TABLE incidents ADD COLUMN onset_at TIMESTAMP;
        ALTER TABLE incidents ADD COLUMN before_s DOUBLE;
        ALTER TABLE incidents ADD COLUMN during_s DOUBLE;
        UPDATE incidents SET first_window = f.window_id, first_step = coalesce(list_min(f.steps), 0)
            FROM findings f WHERE f.id = incidents.first_finding;
        UPDATE incidents SET first_trigger_at = t.created_at
            FROM triggers t WHERE t.job = incidents.job AND t.window_id = incidents.first_window;
        UPDATE incidents SET resolved_reason = CASE WHEN resolved_by = 'stale' THEN 'stale' ELSE 'window' END
            WHERE status = 'resolved';
        CREATE OR REPLACE VIEW gpu_hours_lost_by_cause AS
            SELECT tenant, cause, count(*) AS incidents,
                   count(*) FILTER (WHERE status = 'open') AS open_incidents,
                   coalesce(sum(gpu_hours_per_day) FILTER (WHERE status = 'open'), 0) AS gpu_hours_per_day,
                   sum(gpu_hours_per_day * greatest(0, epoch(coalesce(resolved_at, timezone('UTC', now())) - opened_at)) / 86400) AS gpu_hours_lost
            FROM incidents GROUP BY tenant, cause;
        CREATE VIEW incident_timeline AS
            SELECT id, tenant, job, cause, function, workers, devices, status, first_window, first_step,
                   onset_step, onset_at, first_trigger_at, opened_at AS first_finding_at, resolved_at, resolved_step,
                   resolved_reason, before_s, during_s, after_s,
                   epoch(opened_at - coalesce(onset_at, first_trigger_at)) AS time_to_diagnose_s,
                   CASE WHEN resolved_reason IN ('recovered', 'window')
                        THEN epoch(resolved_at - coalesce(onset_at, opened_at)) END AS time_to_recover_s,
                   gpu_hours_per_day,
                   gpu_hours_per_day * greatest(0, epoch(coalesce(resolved_at, timezone('UTC', now()))
                                                       - coalesce(onset_at, opened_at))) / 86400 AS gpu_hours_lost
            FROM incidents;
        CREATE VIEW incident_outcomes AS
            SELECT tenant, cause, CASE WHEN status = 'open' THEN 'open' ELSE resolved_reason END AS resolution,
                   count(*) AS incidents,
                   median(time_to_diagnose_s) AS median_time_to_diagnose_s,
                   median(time_to_recover_s) AS median_time_to_recover_s,
                   sum(gpu_hours_lost) AS gpu_hours_lost,
                   coalesce(sum(gpu_hours_per_day) FILTER (WHERE resolved_reason IN ('recovered', 'window')), 0)
                       AS gpu_hours_per_day_recovered
            FROM incident_timeline GROUP BY ALL;
        """,
    ),
    (
        6,
        "windows.closed_reason (why a window failed or timed out), trigger_outcomes, failed windows per job",
        """
        ALTER TABLE windows ADD COLUMN closed_reason VARCHAR;
        CREATE VIEW trigger_outcomes AS
            SELECT t.tenant, t.job, t.window_id, t.kind, t.reason AS trigger_reason, t.start_step, t.steps,
                   t.expected_workers, t.created_at AS triggered_at,
                   coalesce(w.closed, 'open') AS closed, w.closed_reason, w.closed_at,
                   w.steps_seen, w.workers_seen, w.coverage, w.findings
            FROM triggers t LEFT JOIN windows w ON w.job = t.job AND w.window_id = t.window_id;
        CREATE OR REPLACE VIEW coverage_by_job AS
            SELECT tenant, job, count(*) AS windows,
                   avg(coverage) AS mean_coverage, min(coverage) AS min_coverage,
                   avg(bytes_per_worker) AS mean_bytes_per_worker,
                   avg(profiling_overhead) AS mean_profiling_overhead,
                   avg(reached_device::INTEGER) AS reached_device_share,
                   count(*) FILTER (WHERE closed = 'timeout') AS timed_out,
                   max(closed_at) AS last_closed_at,
                   count(*) FILTER (WHERE closed = 'failed') AS failed
            FROM windows GROUP BY tenant, job;
        """,
    ),
    (
        7,
        "incidents acknowledged or resolved by hand: incidents.acked_at, acked_by (resolved_reason 'manual'); "
        "sink_offsets.topic_id (offsets of a topic created again are not resumed)",
        """
        ALTER TABLE incidents ADD COLUMN acked_at TIMESTAMP;
        ALTER TABLE incidents ADD COLUMN acked_by VARCHAR;
        ALTER TABLE sink_offsets ADD COLUMN topic_id VARCHAR;
        """,
    ),
]


def migrate(con: duckdb.DuckDBPyConnection, path: Path, data: Mapping[int, Callable[[], None]]) -> int:
    """Bring the file at ``path`` to the latest version: each migration not applied yet, in its own transaction with
    its ``data`` step (rows to fill from the ones already there), recorded in ``schema_migrations``.  Refuses a
    DuckDB file that is not a findings store.  Returns the version."""
    tables = {
        r[0]
        for r in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database()"
        ).fetchall()
    }
    if tables and "schema_migrations" not in tables:  # someone else's DuckDB file: never add our tables to it
        con.close()
        raise StoreError(
            f"{path} is a DuckDB file but not a findings store (it has tables {', '.join(sorted(tables)[:5])}); name another file"
        )
    con.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, description VARCHAR, applied_at TIMESTAMP)"
    )
    done = {r[0] for r in con.execute("SELECT version FROM schema_migrations").fetchall()}
    for version, description, sql in MIGRATIONS:
        if version in done:
            continue
        with transaction(con):
            con.execute(sql)
            if version in data:
                data[version]()
            con.execute("INSERT INTO schema_migrations VALUES (?, ?, now())", [version, description])
        log.info("migrated %s to version %d: %s", path, version, description)
    return max((v for v, _, _ in MIGRATIONS), default=0)
