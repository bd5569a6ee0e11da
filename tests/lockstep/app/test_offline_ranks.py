"""Many rank files diagnosed by a pool of processes: the same findings as one process, and as fewer ranks give."""

from __future__ import annotations

import gzip
import json
import time

import pytest

from lockstep.app.offline import diagnose, expand_inputs, load_inputs
from lockstep.schemas.records import to_builtins
from lockstep.streams.policy import load_policy
from tests.lockstep.commands.test_diagnose_traces import A100, GEMM, slowed

pytestmark = pytest.mark.slow  # 64 real traces read by spawned processes

SLOW = 5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """64 ranks of one job from the real A100 trace, rank 5 with a GEMM 1.5x slower; the rank in each trace."""
    folder = tmp_path_factory.mktemp("ranks")
    base = json.loads(gzip.decompress(A100.read_bytes()))
    slow = slowed(json.loads(gzip.decompress(A100.read_bytes())), GEMM, 1.5)
    for r in range(64):
        t = slow if r == SLOW else base
        t["distributedInfo"] = {**t["distributedInfo"], "rank": r, "world_size": 64}
        (folder / f"rank-{r}.json.gz").write_bytes(gzip.compress(json.dumps(t).encode(), compresslevel=1))
    return folder


def _findings(files, jobs: int, seen: list | None = None) -> list[tuple]:
    policy = load_policy(None)
    inputs = load_inputs(
        files,
        None,
        None,
        policy.diagnosis.peer_group_keys,
        jobs=jobs,
        progress=seen.append if seen is not None else None,
    )
    found = [to_builtins(f) for f in diagnose(inputs, policy, "offline", now=time.time()).findings]
    return sorted((tuple(f["workers"]), f["function"], f["cause"], f["devices"] and tuple(f["devices"])) for f in found)


def test_a_pool_finds_what_one_process_finds_and_what_fewer_ranks_give(ranks):
    files = expand_inputs([ranks])
    assert len(files) == 64
    seen: list = []
    pooled = _findings(files, jobs=4, seen=seen)
    assert sorted(seen) == sorted(files)  # progress heard of every file
    one: list = []
    assert pooled == _findings(files, jobs=1, seen=one)
    assert sorted(one) == sorted(files)  # read in this process too
    slowed_rank = [f for f in pooled if SLOW in f[0]]
    assert slowed_rank and all(w == (SLOW,) for w, *_ in slowed_rank), pooled
    assert any(GEMM in fn for _, fn, *_ in slowed_rank), slowed_rank
    few = _findings([ranks / f"rank-{r}.json.gz" for r in range(8)], jobs=1)  # a direct run on 8 of the ranks
    assert [f for f in few if SLOW in f[0]] == slowed_rank


def test_an_unreadable_file_in_the_pool_names_itself(ranks, tmp_path):
    from lockstep.app.offline import DiagnoseError

    bad = tmp_path / "rank-99.json"
    bad.write_text('{"traceEvents": [')
    with pytest.raises(DiagnoseError, match=r"rank-99\.json: not a Chrome-trace JSON object"):
        load_inputs([*expand_inputs([ranks])[:16], bad], None, None, jobs=2)  # 17 files: read by the pool
