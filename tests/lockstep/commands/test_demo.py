"""``lockstep demo``'s words about the fault it injected."""

from lockstep.commands.demo import fault_target
from lockstep.producers.simulator.faults import Fault
from lockstep.producers.simulator.topology import Topology


def test_the_injected_fault_names_what_it_hits_hosts_and_links_included():
    topo = Topology(workers=64, gpus_per_host=8, nics_per_host=2)
    assert fault_target(Fault(type="gpu_throttle_thermal", workers=(13,)), topo) == "worker 13"
    assert fault_target(Fault(type="gpu_slow", workers=(3, 5)), topo) == "workers 3, 5"
    assert fault_target(Fault(type="host_cpu_contention", hosts=(3,)), topo) == "host node0003"  # was "workers  of"
    assert fault_target(Fault(type="nic", nics=("node0003/bond1",)), topo) == "NIC node0003/bond1"
