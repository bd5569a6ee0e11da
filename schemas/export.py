"""Publish the contracts for producers written in other languages.

``python -m lockstep.schemas.export`` (or ``lockstep schemas --write``) writes:

- ``schemas/json/<Record>.json``: a JSON Schema per record (JSON or MessagePack on the wire);
- ``schemas/arrow/function_table.txt``: the function table's columns, types and meaning;
- ``schemas/arrow/function_table.schema``: the same schema as a serialised Arrow schema
  (``pyarrow.ipc.read_schema`` / ``arrow::ipc::ReadSchema`` read it);
- ``schemas/arrow/window_table.{txt,schema}``: the same for the window table a ``WindowFeatures`` carries.

A test keeps the committed files equal to what the code defines.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import msgspec

from . import functions
from .records import RECORD_TYPES

HERE = Path(__file__).resolve().parent


def _clean_descriptions(node: Any) -> Any:
    """Dedent every ``description`` the same way on every msgspec release.

    msgspec 0.22 cleaned docstrings itself and 0.23 leaves their indentation in; the
    published files must not depend on which one is installed.
    """
    if isinstance(node, dict):
        return {
            k: inspect.cleandoc(v) if k == "description" and isinstance(v, str) else _clean_descriptions(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_clean_descriptions(v) for v in node]
    return node


def json_schemas() -> dict[str, str]:
    out = {}
    for name, typ in RECORD_TYPES.items():
        schema = _clean_descriptions(msgspec.json.schema(typ))
        schema["$id"] = f"https://lockstep.dev/schemas/{name}.v1.json"
        schema["description"] = (typ.__doc__ or "").strip().splitlines()[0]
        out[f"json/{name}.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return out


def arrow_files() -> dict[str, bytes | str]:
    return {
        "arrow/function_table.txt": functions.describe(),
        "arrow/function_table.schema": functions.SCHEMA.serialize().to_pybytes(),
        "arrow/window_table.txt": functions.describe_window(),
        "arrow/window_table.schema": functions.WINDOW_SCHEMA.serialize().to_pybytes(),
    }


def expected_files() -> dict[str, bytes | str]:
    return {**json_schemas(), **arrow_files()}


def write(root: Path = HERE) -> list[Path]:
    written = []
    for rel, content in expected_files().items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content)
        else:
            path.write_bytes(content)
        written.append(path)
    return written


if __name__ == "__main__":
    for p in write():
        print(p)
