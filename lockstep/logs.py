"""Logging of every process (the commands, the processor, the sink): ``text`` lines or ``json`` objects on stderr."""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (ISO, UTC), level, logger, message, and the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str = "INFO", fmt: str = "text", client_logs: bool = True) -> None:
    """Every command's logging, the processor's included: ``text`` lines or ``json`` objects on stderr.

    Without ``client_logs`` (the one-shot commands: ``trigger``, ``raw``, ``topics``, ``simulate``) librdkafka's own
    lines (a ``FAIL ... Connection refused`` per retry) are shown only at level DEBUG: the command's error says what
    failed, in one line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT, datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level, logging.INFO))
    for noisy in ("faust", "mode", "aiokafka", "kafka", "lockstep.librdkafka", "aiohttp"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    if not client_logs and root.level > logging.DEBUG:
        logging.getLogger("lockstep.librdkafka").setLevel(logging.CRITICAL + 1)
