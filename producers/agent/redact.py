"""Redaction of what leaves the host: source paths, call stacks, function names.

Applied to every function key of a feature batch and to every raw-trace slice
before either is handed to Kafka.  Hashes are salted SHA-256 prefixes of the
(path-normalised) name, so the same function gets the same key on every worker
of a job as long as the workers share the salt; give each tenant a secret salt
to keep names from being guessed from well-known ones.

``paths``  keep | strip (directories removed, file name kept) | hash (directories hashed)
``stacks`` keep | drop (call stacks and Python-tracer parent links removed from raw traces)
``names``  keep | hash (the whole function key replaced by ``fn:<hash>``)
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

PATH_MODES = ("keep", "strip", "hash")
STACK_MODES = ("keep", "drop")
NAME_MODES = ("keep", "hash")

# a run of directories before a source file name, e.g. /home/a/proj/train.py or torch/nn/modules/module.py;
# group 1 is the file name (RE2, which pyarrow uses, has no look-ahead)
_DIRS = r"(?:[A-Za-z]:)?(?:[\w.~@+-]*[/\\])+([\w.~@+-]+\.(?:py|pyx|cpp|cc|cu|h|hpp|c)\b)"
_DIRS_RE = re.compile(_DIRS)
_STEP_RE = re.compile(r"ProfilerStep#\d+$")  # step markers are the profiler's, never the customer's
#: argument keys of Chrome-trace events that hold call stacks or links between Python frames
STACK_ARGS = ("Call stack", "stack", "Python parent id", "Python id", "Python module id")


def _hash(salt: str, text: str, n: int = 16) -> str:
    return hashlib.sha256(f"{salt}\x1f{text}".encode()).hexdigest()[:n]


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

    # ------------------------------------------------------------------ names

    def name(self, name: str) -> str:
        """One function name as it may leave the host."""
        if self.paths == "strip":
            name = _DIRS_RE.sub(r"\1", name)
        elif self.paths == "hash":
            name = _DIRS_RE.sub(lambda m: f"<{_hash(self.salt, m.group(0)[: m.start(1) - m.start(0)], 8)}>/{m.group(1)}", name)
        if self.names == "hash":
            name = "fn:" + _hash(self.salt, name)
        return name

    def names_array(self, names: pa.Array | pa.ChunkedArray) -> pa.Array:
        """Vectorised over a column of function names: each distinct name is redacted once."""
        if self.paths == "keep" and self.names == "keep":
            return names
        if self.paths == "strip" and self.names == "keep":
            return pc.replace_substring_regex(names, _DIRS, r"\1")
        enc = pc.dictionary_encode(names)
        enc = enc.combine_chunks() if isinstance(enc, pa.ChunkedArray) else enc
        mapped = pa.array([self.name(n) for n in enc.dictionary.to_pylist()], pa.string())
        return pc.take(mapped, enc.indices)

    def table(self, table: pa.Table, column: str = "function") -> pa.Table:
        """A table whose ``column`` holds function names, redacted."""
        if self.paths == "keep" and self.names == "keep":
            return table
        i = table.schema.get_field_index(column)
        return table.set_column(i, table.schema.field(i), self.names_array(table.column(column)))

    # ------------------------------------------------------------------ raw traces

    def trace(self, trace: dict[str, Any]) -> dict[str, Any]:
        """A Chrome-trace object as it may leave the host (a new object; the input is not changed)."""
        if self.is_identity:
            return trace
        cache: dict[str, str] = {}
        events = []
        for ev in trace.get("traceEvents", []):
            ev = dict(ev)
            name = ev.get("name")
            if isinstance(name, str) and ev.get("ph") != "M" and not _STEP_RE.match(name):
                if name not in cache:
                    cache[name] = self.name(name)
                ev["name"] = cache[name]
            args = ev.get("args")
            if isinstance(args, dict):
                if self.stacks == "drop" and any(k in args for k in STACK_ARGS):
                    args = {k: v for k, v in args.items() if k not in STACK_ARGS}
                ev["args"] = args
            events.append(ev)
        out = {k: v for k, v in trace.items() if k not in ("traceEvents", "traceName")}
        out["traceEvents"] = events
        return out
