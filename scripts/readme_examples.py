"""The README's example outputs, run again: ``--check`` says where they differ, ``--write`` puts today's in.

    python scripts/readme_examples.py --check   # exit 1 and a diff when an example's output changed
    python scripts/readme_examples.py --write   # rewrite the outputs in README.md

An example is marked in README.md by an HTML comment line ``<!-- example: checked by scripts/readme_examples.py -->``
followed by a ``sh`` block with one ``lockstep ...`` command (globs expanded as a shell does, sorted; run
from the repository's root) and then a block with what it prints: its stderr lines first (the notes come
before the table), then its stdout.  A command that reads files of the repository and prints the same thing
every time (``lockstep diagnose tests/data/...``) is compared exactly; one whose output varies from run to run
says so with the options below.  ``tests/test_readme_examples.py`` runs ``--check`` (the offline examples in the
slow tier, all of them with one demo run in the integration tier), so an example that goes stale fails the tests,
and after a change ``--write`` makes the README say what the command now prints.

Options after the mark's text, each after a ``;``, say how an example is run and compared:

- ``stdout``: only what the command prints on stdout (its log lines on stderr vary with the clock).
- ``on the demo's store``: the command reads the findings store of one ``lockstep demo`` run (``--db`` is
  added), the demo run once for every example that needs it (``lockstep demo`` itself included).
- ``one run's output``: what varies from run to run (a real run of processes: timings, record counts) is
  compared loosely: every line must have the same words, the temporary folders, window ids and ``Done in``
  durations may differ, and each number must be within a factor of :data:`FACTOR` of the shown one (or
  :data:`SMALL` of it, for small counts): a stale figure (4,992 heartbeat records shown, 640 now) fails.

``--offline`` checks only the examples that start no process but the command (no ``lockstep demo``).
"""

from __future__ import annotations

import argparse
import difflib
import glob
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARK = "<!-- example: checked by scripts/readme_examples.py -->"
_MARK = re.compile(r"<!-- example: checked by scripts/readme_examples\.py((?:; [^;>]+)*) -->")
OPTIONS = ("stdout", "on the demo's store", "one run's output")
_FENCE = re.compile(r"^```")
#: ``one run's output``: numbers agree within this factor of each other ...
FACTOR = 1.5
#: ... or this far apart (small counts: 8 or 9 step reports)
SMALL = 3.0
_NUMBER = re.compile(r"(?<![\w])[-+]?\d[\d,]*(?:\.\d+)?(?![\w])")
#: what may differ in one run's output whatever its size: temporary folders, window ids, the demo's duration
_VOLATILE = (
    (re.compile(r"/tmp/lockstep-demo-\w+"), "/tmp/lockstep-demo-…"),
    (re.compile(r"\bw\d+\b"), "w…"),
    (re.compile(r"Done in [\d.]+ s"), "Done in … s"),
)


@dataclass
class Example:
    command: str
    out_start: int  # first line of the output block's content (0-based, in README's lines)
    out_end: int  # its closing fence
    shown: str
    options: tuple[str, ...] = ()


def examples(lines: list[str]) -> list[Example]:
    found = []
    for i, line in enumerate(lines):
        m = _MARK.fullmatch(line.strip())
        if not m:
            continue
        options = tuple(o.strip() for o in m.group(1).split(";") if o.strip())
        if unknown := [o for o in options if o not in OPTIONS]:
            raise SystemExit(f"README.md:{i + 1}: unknown option(s) {unknown}; known: {OPTIONS}")
        fences = [j for j in range(i + 1, len(lines)) if _FENCE.match(lines[j])][:4]
        if len(fences) < 4 or fences[0] != i + 1 or fences[2] != fences[1] + 1:
            raise SystemExit(f"README.md:{i + 1}: the mark must be followed by a sh block and an output block")
        command = "\n".join(lines[fences[0] + 1 : fences[1]]).strip()
        # one command, which may go on over lines inside its quotes (a long SQL query)
        if not command.startswith("lockstep ") or "\nlockstep" in command or "\n#" in command:
            raise SystemExit(f"README.md:{i + 1}: an example is one `lockstep ...` command, got {command!r}")
        shown = "\n".join(lines[fences[2] + 1 : fences[3]])
        found.append(Example(command, fences[2] + 1, fences[3], shown, options))
    return found


def _numbers_agree(a: str, b: str) -> bool:
    x, y = abs(float(a.replace(",", ""))), abs(float(b.replace(",", "")))
    return abs(x - y) <= SMALL or max(x, y) <= FACTOR * min(x, y)


def agree(shown: str, now: str, options: tuple[str, ...] = ()) -> bool:
    """Whether the README shows what the command printed: exactly, or loosely for ``one run's output``."""
    if "one run's output" not in options:
        return shown == now
    a, b = shown.split("\n"), now.split("\n")
    if len(a) != len(b):
        return False
    for la, lb in zip(a, b):
        for pattern, mask in _VOLATILE:
            la, lb = pattern.sub(mask, la), pattern.sub(mask, lb)
        if _NUMBER.sub("#", la).split() != _NUMBER.sub("#", lb).split():
            return False
        if not all(_numbers_agree(x, y) for x, y in zip(_NUMBER.findall(la), _NUMBER.findall(lb))):
            return False
    return True


DEMO = "lockstep demo"
_ran: dict[str, tuple[str, str]] = {}  # command -> (stdout, stderr): the demo runs once for every example


def _execute(command: str, extra: tuple[str, ...] = ()) -> tuple[str, str]:
    key = " ".join((command, *extra))
    if key in _ran:
        return _ran[key]
    argv: list[str] = []
    for word in shlex.split(command)[1:]:
        matched = sorted(glob.glob(word, root_dir=ROOT)) if any(c in word for c in "*?[") else []
        argv += matched or [word]
    env = {**os.environ, "COLUMNS": "200", "LOCKSTEP_TRACEBACK": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "lockstep", *argv, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if p.returncode:
        raise SystemExit(f"`{command}` failed ({p.returncode}):\n{p.stderr}")
    _ran[key] = (p.stdout, p.stderr)
    return _ran[key]


def demo_store() -> str:
    """The findings store of this check's one ``lockstep demo`` run."""
    m = re.search(r"^Findings in (\S+):$", _execute(DEMO)[0], re.M)
    if not m:
        raise SystemExit(f"`{DEMO}` did not say where its findings are:\n{_execute(DEMO)[0]}")
    return m.group(1)


def run(command: str, options: tuple[str, ...] = ()) -> str:
    """What the command prints (stderr, then stdout; stdout only with ``stdout``), globs expanded as a shell
    would, from the root; on the demo's findings store with ``on the demo's store``."""
    extra = ("--db", demo_store()) if "on the demo's store" in options else ()
    out, err = _execute(command, extra)
    text = out if "stdout" in options else err + ("\n" if err and out else "") + out
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def starts_processes(ex: Example) -> bool:
    return ex.command == DEMO or "on the demo's store" in ex.options


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--check", action="store_true", help="exit 1 with a diff when an output differs")
    what.add_argument("--write", action="store_true", help="rewrite the outputs in README.md")
    ap.add_argument("--offline", action="store_true", help="only the examples that start no process (no demo)")
    a = ap.parse_args(argv)
    lines = README.read_text().split("\n")
    found = [ex for ex in examples(lines) if not (a.offline and starts_processes(ex))]
    if not found:
        print(f"no example marked {MARK} in README.md", file=sys.stderr)
        return 1
    stale = 0
    for ex in reversed(found):  # from the end: rewriting one leaves the line numbers of those before it
        now = run(ex.command, ex.options)
        if agree(ex.shown, now, ex.options):
            continue
        stale += 1
        if a.write:
            lines[ex.out_start : ex.out_end] = now.split("\n")
        else:
            diff = difflib.unified_diff(
                ex.shown.split("\n"), now.split("\n"), "README.md", ex.command, lineterm="", n=1
            )
            print(f"README.md:{ex.out_start + 1}: `{ex.command}` prints something else now:", *diff, sep="\n")
    if a.write and stale:
        README.write_text("\n".join(lines))
    print(
        f"{len(found)} examples, {stale} {'rewritten' if a.write else 'stale'}"
        + ("" if a.write or not stale else " (python scripts/readme_examples.py --write)"),
        file=sys.stderr,
    )
    return 1 if stale and a.check else 0


if __name__ == "__main__":
    sys.exit(main())
