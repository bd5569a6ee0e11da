"""``lockstep schemas``: publish or check the JSON Schemas and the Arrow schema."""

from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser(
        "schemas", help="write or check the published JSON Schemas and Arrow schema (schemas/json, schemas/arrow)"
    )
    p.add_argument("--check", action="store_true", help="exit 1 if the published files differ from the code")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..schemas import export

    if args.check:
        stale = []
        for rel, content in export.expected_files().items():
            path = export.HERE / rel
            have = path.read_bytes() if path.exists() else None
            want = content.encode() if isinstance(content, str) else content
            if have != want:
                stale.append(rel)
        if stale:
            print(f"out of date: {', '.join(stale)} (run `lockstep schemas`)", file=sys.stderr)
            return 1
        print("published schemas are up to date")
        return 0
    for path in export.write():
        print(path)
    return 0
