"""Redaction of what leaves the host: source paths, data paths, URLs, call stacks, function names.

One implementation for both things that leave: the op events' function names (before
they are summarised into feature batches, so two names that redact alike become one
function) and raw-trace slices.  It works by allow-list: what it does not know to be
harmless does not leave.

``paths``  keep | strip | hash.  ``strip``: of any path only its final file name is kept,
           whatever its characters or extension (``/home/first last/x.ipynb(3): f`` ->
           ``x.ipynb(3): f``); a path inside a label keeps only its file name too
           (``load /data/team-a/customers.csv`` -> ``load customers.csv``: everything of the
           text up to the last ``/`` or ``\\`` of the path goes, URL-encoded ones too:
           ``%2F``, ``%5C``); a URL becomes ``<url>``.
           ``hash``: the same, with what was removed replaced by ``<keyed hash>/``.  In raw
           traces, with anything but ``keep``, arguments keep numbers and only the texts of
           :data:`TEXT_ARGS` (scrubbed the same way), metadata events only :data:`META_EVENTS`,
           and the trace only its :data:`TRACE_KEYS`.
``stacks`` keep | drop (call stacks and Python-tracer parent links removed from raw traces)
``names``  keep | hash (the whole function key replaced by ``fn:<keyed hash>``)

Hashes are HMAC-SHA256 under ``salt``, 128 bits: the same name gets the same key on every
worker that shares the salt, and without the salt no one can test a guess.  Hashing without
a salt is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

PATH_MODES = ("keep", "strip", "hash")
STACK_MODES = ("keep", "drop")
NAME_MODES = ("keep", "hash")

_STEP_RE = re.compile(r"ProfilerStep#\d+$")  # step markers are the profiler's, never the customer's
_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]*")
#: characters before which a path cannot have started (a path starts after a space, a quote, a bracket, ...)
_BEFORE_PATH = " \t\n\"'`=,;([{<"
#: argument keys of Chrome-trace events that hold call stacks or links between Python frames
STACK_ARGS = ("Call stack", "stack", "Python parent id", "Python id", "Python module id")
#: argument keys whose texts may leave (scrubbed of paths and URLs); other texts in arguments are dropped
TEXT_ARGS = frozenset(
    {
        "name",
        "labels",
        "Input type",
        "dtype",
        "kind",
        "Collective name",
        "Process Group Name",
        "Process Group Description",
        "Process Group Ranks",
        "In split size",
        "Out split size",
        "Trace name",
    }
)
#: metadata events (``ph: M``) that may leave; the others (e.g. a process's command line) are dropped
META_EVENTS = frozenset({"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"})
#: top-level keys of a Chrome trace that may leave (scrubbed); others (``hostName``, ``traceName``, ...) are dropped
TRACE_KEYS = frozenset(
    {
        "schemaVersion",
        "deviceProperties",
        "distributedInfo",
        "baseTimeNanoseconds",
        "displayTimeUnit",
        "trace_id",
        "cupti_version",
        "cuda_runtime_version",
        "cuda_driver_version",
        "traceEvents",
    }
)


def keyed_hash(salt: str, text: str) -> str:
    """128 bits of HMAC-SHA256 of ``text`` under ``salt``, as hex."""
    return hmac.new(salt.encode(), text.encode(), hashlib.sha256).hexdigest()[:32]


#: a path's separators: ``/`` and ``\\``, also URL-encoded (``%2F``, ``%5C``, either case, encoded again as ``%252F``)
_SEP_RE = re.compile(r"[/\\]|%(?:25)*(?:2[Ff]|5[Cc])")


def _path_span(text: str) -> tuple[int, int] | None:
    """(start, end) of the directories of the path(s) in ``text``: from the start of the word holding the first
    separator to just after the last one (``/srv%2Fjane%2Fx.csv`` is a path too).  None without a separator."""
    if "/" not in text and "\\" not in text and "%" not in text:
        return None
    first = _SEP_RE.search(text)
    if first is None:
        return None
    end = first.end()
    for m in _SEP_RE.finditer(text, end):
        end = m.end()
    start = first.start()
    while start > 0 and text[start - 1] not in _BEFORE_PATH:
        start -= 1
    return start, end


@dataclass(frozen=True)
class Redaction:
    paths: str = "strip"
    stacks: str = "drop"
    names: str = "keep"
    salt: str = ""

    def __post_init__(self) -> None:
        for attr, modes in (("paths", PATH_MODES), ("stacks", STACK_MODES), ("names", NAME_MODES)):
            if getattr(self, attr) not in modes:
                raise ValueError(f"{attr}={getattr(self, attr)!r}: expected one of {', '.join(modes)}")
        if "hash" in (self.paths, self.names) and not self.salt:
            raise ValueError(
                "hashing (paths=hash or names=hash) needs a secret salt=...: the same for every worker of a "
                "tenant, and known to no one else (without it, a hash of a well-known name is a lookup away)"
            )

    @classmethod
    def parse(cls, spec: str) -> Redaction:
        """``paths=strip,stacks=drop,names=hash,salt=S``; ``none`` keeps everything; unset keys keep their defaults."""
        spec = spec.strip()
        if spec == "none":
            return cls(paths="keep", stacks="keep", names="keep")
        kw: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in ("paths", "stacks", "names", "salt"):
                raise ValueError(f"expected paths=..., stacks=..., names=... or salt=..., got {part!r}")
            kw[key] = value
        return cls(**kw)

    def spec(self, with_salt: bool = False) -> str:
        """The redaction as text; without the salt unless asked (records say what was applied, not the secret)."""
        text = f"paths={self.paths},stacks={self.stacks},names={self.names}"
        return f"{text},salt={self.salt}" if with_salt and self.salt else text

    @property
    def is_identity(self) -> bool:
        return self.paths == "keep" and self.stacks == "keep" and self.names == "keep"

    # ------------------------------------------------------------------ texts and names

    def text(self, text: str) -> str:
        """A text as it may leave the host: URLs and the directories of paths removed (``paths=keep``: unchanged)."""
        if self.paths == "keep":
            return text
        text = _URL_RE.sub("<url>", text)
        span = _path_span(text)
        if span is None:
            return text
        start, end = span
        if self.paths == "hash":
            return f"{text[:start]}<{keyed_hash(self.salt, text[start:end])}>/{text[end:]}"
        return text[:start] + (text[end:] or "<path>")  # a path that ends in a separator names no file

    def name(self, name: str) -> str:
        """One function name as it may leave the host."""
        name = self.text(name)
        return "fn:" + keyed_hash(self.salt, name) if self.names == "hash" else name

    def connections(self, table: pa.Table) -> pa.Table:
        """A connection table as it may leave the host: with ``names=hash`` its endpoints' addresses hashed too
        (``ep:<hash>:<port>``), under the same salt on every worker, so that a connection's two ends still match
        across workers, and a connection within one host (both ends one address) still shows as one."""
        if self.names != "hash" or table.num_rows == 0:
            return table

        def hashed(endpoint: str) -> str:
            address, _, port = endpoint.rpartition(":")
            return f"ep:{keyed_hash(self.salt, address)}:{port}"

        for column in ("local", "peer"):
            i = table.schema.get_field_index(column)
            table = table.set_column(
                i, table.schema.field(i), pa.array([hashed(e) for e in table.column(column).to_pylist()])
            )
        return table

    def names_array(self, names: pa.Array | pa.ChunkedArray) -> pa.Array:
        """Vectorised over a column of function names: each distinct name is redacted once (by :meth:`name`)."""
        if self.paths == "keep" and self.names == "keep":
            return names
        enc = pc.dictionary_encode(names)
        enc = enc.combine_chunks() if isinstance(enc, pa.ChunkedArray) else enc
        mapped = pa.array([None if n is None else self.name(n) for n in enc.dictionary.to_pylist()], pa.string())
        return pc.take(mapped, enc.indices)

    def table(self, table: pa.Table, column: str = "function") -> pa.Table:
        """A table whose ``column`` holds function names, redacted."""
        if self.paths == "keep" and self.names == "keep":
            return table
        i = table.schema.get_field_index(column)
        return table.set_column(i, table.schema.field(i), self.names_array(table.column(column)))

    # ------------------------------------------------------------------ raw traces

    def _scrub(self, value: Any) -> Any:
        """Texts anywhere inside ``value`` scrubbed (:meth:`text`); numbers and booleans as they are."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self._scrub(v) for v in value]
        if isinstance(value, dict):
            return {k: self._scrub(v) for k, v in value.items()}
        return value

    def _args(self, args: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for k, v in args.items():
            if self.stacks == "drop" and k in STACK_ARGS:
                continue
            if self.paths != "keep" and k not in TEXT_ARGS and _holds_text(v):
                continue  # a text no one listed as harmless (e.g. "Concrete Inputs": an operator's arguments)
            out[k] = self._scrub(v)
        return out

    def trace(self, trace: dict[str, Any]) -> dict[str, Any]:
        """A Chrome-trace object as it may leave the host (a new object; the input is not changed)."""
        if self.is_identity:
            return trace
        cache: dict[str, str] = {}
        events = []
        for ev in trace.get("traceEvents", []):
            if not isinstance(ev, dict):
                continue
            meta = ev.get("ph") == "M"
            if meta and self.paths != "keep" and ev.get("name") not in META_EVENTS:
                continue
            ev = {k: (self._scrub(v) if k not in ("name", "args") else v) for k, v in ev.items()}
            name = ev.get("name")
            if isinstance(name, str) and not meta and not _STEP_RE.match(name):
                if name not in cache:
                    cache[name] = self.name(name)
                ev["name"] = cache[name]
            if isinstance(ev.get("args"), dict):
                ev["args"] = self._args(ev["args"])
            events.append(ev)
        if self.paths == "keep":
            out = {k: v for k, v in trace.items() if k not in ("traceEvents", "traceName")}
        else:
            out = {k: self._scrub(v) for k, v in trace.items() if k in TRACE_KEYS}
        out["traceEvents"] = events
        return out


def _holds_text(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if isinstance(value, list):
        return any(_holds_text(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_text(v) for v in value.values())
    return False
