"""The fault catalogue: every fault has a ground truth the evaluation can judge against."""

from lockstep.producers.simulator.faults import CATALOGUE, Fault
from lockstep.producers.simulator.model import IDX
from lockstep.producers.simulator.topology import Topology
from lockstep.schemas.records import CAUSES


def test_every_fault_has_a_ground_truth():
    topo = Topology(workers=128, pp=4)
    for name, kind in CATALOGUE.items():
        target = {
            "workers": {"workers": (9,)},
            "hosts": {"hosts": (1,)},
            "nics": {"nics": ("node0001/bond0",)},
            "switches": {"switches": ("leaf000",)},
            "stage": {"stage": 1},
            "function": {"function": "fwd.attention"},
        }[kind.target]
        t = Fault(type=name, **target).truth(topo)
        if kind.cause is None:
            assert t.cause is None and t.workers == []
            continue
        assert t.cause in CAUSES and t.functions and all(f in IDX for f in t.functions)
        assert t.scope in ("worker", "group", "job")
        assert bool(t.workers) == (t.scope != "job")
