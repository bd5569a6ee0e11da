"""The root of every error Lockstep raises on purpose.

Every error a user can cause (a bad setting, file, record, query, an unreachable Kafka, a refused window)
is a :class:`LockstepError`, whose message says what is wrong and what to do; the command line prints it
in one line.  Each subclass is also the builtin it resembles (``RecordError`` is a ``ValueError``,
``StoreError`` a ``RuntimeError``), so code that catches builtins keeps working.  Anything else that
reaches the command line is a bug.

It lives with the schemas because they import nothing of ours: every layer can import it.
"""

from __future__ import annotations


class LockstepError(Exception):
    """Something Lockstep refuses or cannot do, with a message that says why and what to do."""
