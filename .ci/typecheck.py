"""mypy on the ``lockstep`` package as it installs: ``.venv/bin/python .ci/typecheck.py [mypy options]``.

The pipeline's folders sit at the repository's top (``schemas/``, ``streams/``, ...) and install as
``lockstep.schemas``, ``lockstep.streams``, ... (``package-dir`` in pyproject.toml), which mypy cannot map.
This builds that package as a tree of links in ``build/typecheck/`` from pyproject.toml's ``package-dir``,
runs mypy there with pyproject.toml's ``[tool.mypy]`` (strict modules, overrides), and prints the paths
as they are in the repository.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "typecheck"


def build_tree() -> dict[str, str]:
    """Links ``build/typecheck/<package path>`` -> the folder it installs from; returns tree path -> repository path."""
    package_dir: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    top = TREE / "lockstep"
    top.mkdir(parents=True, exist_ok=True)
    wanted: dict[Path, Path] = {}
    for entry in (ROOT / package_dir["lockstep"]).iterdir():
        if entry.name != "__pycache__":
            wanted[top / entry.name] = entry
    for package, folder in package_dir.items():
        if package != "lockstep":
            wanted[TREE.joinpath(*package.split("."))] = ROOT / folder
    for link in top.iterdir():  # a module renamed or removed since the last run
        if link not in wanted:
            link.unlink()
    for link, target in wanted.items():
        if not (link.is_symlink() and Path(os.readlink(link)) == target):
            if link.is_symlink():
                link.unlink()
            link.symlink_to(target)
    return {
        f"{link.relative_to(TREE)}/": f"{target.relative_to(ROOT)}/"
        for link, target in wanted.items()
        if target.is_dir()
    }


def main() -> int:
    paths = build_tree()
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "lockstep", *sys.argv[1:]]
    proc = subprocess.run(cmd, cwd=TREE, capture_output=True, text=True)
    # longest first: lockstep/streams/ before lockstep/
    pattern = re.compile("|".join(re.escape(p) for p in sorted(paths, key=len, reverse=True)))
    for stream, text in ((sys.stdout, proc.stdout), (sys.stderr, proc.stderr)):
        stream.write(pattern.sub(lambda m: paths[m.group(0)], text))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
