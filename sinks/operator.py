"""What an operator changes in the findings file: incidents acknowledged or resolved by hand, retention (prune).

DuckDB lets one process write a file.  When the file is free the command opens it itself (as the sink would: it
migrates it); when a sink holds it, the command asks that sink through its HTTP port with the token from the
sidecar (:func:`.http.ask`), and the sink runs the change on its own thread between two batches
(:meth:`.sink.Sink.submit`).  Either way the change is one transaction, and the incident events it appends are
paged by the sink's pager (at once when the sink runs; when it next runs otherwise).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from .store import FindingsStore, StoreError, StoreLocked

Action = Literal["acknowledge", "resolve"]
PATHS = {"acknowledge": "/incidents/ack", "resolve": "/incidents/resolve"}


def _open(db: Path | str) -> FindingsStore | None:
    """The file's read-write handle, or None when a sink holds it."""
    if not Path(db).is_file():
        raise StoreError(f"{db}: no such findings file (--db names the sink's file)")
    try:
        return FindingsStore(db)
    except StoreLocked:
        return None


def change_incident(
    db: Path | str, action: Action, incident_id: str, by: str, tenant: str | None = None
) -> tuple[dict[str, Any], bool]:
    """Acknowledge or resolve an incident by hand.  Returns the incident (its fields) and whether it changed."""
    from .http import ask

    store = _open(db)
    if store is None:
        body = ask(db, PATHS[action], {"id": incident_id, "by": by, "tenant": tenant})
        return body["incident"], bool(body["changed"])
    try:
        inc, events = (store.acknowledge if action == "acknowledge" else store.resolve)(incident_id, by, tenant)
    finally:
        store.close()
    return dataclasses.asdict(inc), bool(events)


def prune(db: Path | str, older_than_s: float) -> dict[str, int]:
    """Delete what is older than ``older_than_s`` (:meth:`.store.FindingsStore.prune`).  Returns rows by table."""
    from .http import ask

    store = _open(db)
    if store is None:
        return dict(ask(db, "/prune", {"older_than_s": older_than_s}, timeout_s=600.0)["pruned"])
    try:
        return dataclasses.asdict(store.prune(older_than_s))
    finally:
        store.close()
