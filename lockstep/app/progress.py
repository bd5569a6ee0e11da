"""Progress on stderr for the long commands (demo, evaluate, simulate, diagnose, long queries).

Shown only when a person is watching: stderr is a terminal and the output is for people (not
``--json``).  Otherwise every call here does nothing, so that logs, pipes and programs see only
what they asked for.  Built on tqdm; log records printed while a bar is shown go above it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time


def wanted(json_output: bool = False) -> bool:
    """A person reads stderr (a terminal) and the command prints for people."""
    try:
        return not json_output and sys.stderr.isatty()
    except (AttributeError, ValueError):  # no stderr, or a closed one
        return False


class Progress:
    """A bar (``total`` known) or a status line with the elapsed time (``total=None``); inert when disabled.
    ``delay_s``: show nothing unless the work lasts that long (a query that answers at once prints nothing)."""

    def __init__(self, enabled: bool, desc: str = "", total: int | None = None, unit: str = "it", delay_s: float = 0.0):
        self._bar = None
        self._show_at = time.monotonic() + delay_s
        self._logs = contextlib.ExitStack()
        self._ticker: threading.Thread | None = None
        self._done = threading.Event()
        if not enabled:
            return
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        fmt = None if total is not None else "{desc} [{elapsed}]"
        self._bar = tqdm(
            total=total,
            desc=desc,
            unit=unit,
            file=sys.stderr,
            leave=False,
            dynamic_ncols=True,
            bar_format=fmt,
            delay=delay_s,
        )
        self._logs.enter_context(logging_redirect_tqdm())
        if total is None:  # a status line: keep its clock moving while the work is silent
            self._ticker = threading.Thread(target=self._tick, name="progress", daemon=True)
            self._ticker.start()

    def _shown(self) -> bool:
        return time.monotonic() >= self._show_at

    def _tick(self) -> None:
        while not self._done.wait(0.5):
            bar = self._bar
            if bar is not None and self._shown():
                bar.refresh()

    def set_total(self, total: int) -> None:
        if self._bar is not None and self._bar.total != total:
            self._bar.total = total

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def status(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(text, refresh=self._shown())

    def close(self) -> None:
        self._done.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2)
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._logs.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
