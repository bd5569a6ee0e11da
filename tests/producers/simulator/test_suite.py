"""The standard suite: its files are what the generator writes; a held-out suite has its shape with other jobs."""

import pytest

from lockstep.app.evaluate import STANDARD_SUITE, load_suite
from lockstep.producers.simulator.faults import CATALOGUE
from lockstep.producers.simulator.suite import CATEGORIES, render, standard_suite
from lockstep.producers.simulator.suite import main as suite_main


@pytest.mark.slow  # generates the whole standard suite: 250 scenarios, each simulated to calibrate its severity
def test_the_standard_suite_files_load_and_are_what_the_generator_writes():
    suite = standard_suite()
    files = sorted(STANDARD_SUITE.glob("*.yaml"))
    assert len(files) == len(suite) >= 200
    assert {f.name for f in files} == {f"{s.name}.yaml" for s in suite}
    by_name = {s.name: s for s in suite}
    for f in files:
        assert f.read_text() == render(by_name[f.stem]), (
            f"{f.name} differs from the generator: python -m lockstep.producers.simulator.suite suites/standard"
        )
    loaded = load_suite(STANDARD_SUITE)
    assert [s.to_dict() for s in loaded] == [by_name[f.stem].to_dict() for f in files]
    assert (
        {s.category for s in loaded}
        == set(CATEGORIES)
        == set(CATALOGUE) | {"two_faults", "healthy", "small_job", "no_samples"}
    )
    sizes = {s.topology.workers for s in loaded}
    assert min(sizes) == 2 and max(sizes) == 4096
    assert (
        any(s.topology.pp > 1 for s in loaded)
        and any(s.topology.tp > 1 for s in loaded)
        and any(s.workload.moe for s in loaded)
    )
    # the rates a window's sampler runs at; jobs of 2 and 3 workers (healthy ones too); samplers that see less
    assert {s.hardware_hz for s in loaded} <= {1000.0, 2000.0, 10000.0}
    small = [s for s in loaded if s.category == "small_job"]
    assert {s.topology.workers for s in small} == {2, 3} and any(not s.faults for s in small)
    blind = [s for s in loaded if s.category == "no_samples"]
    assert {s.hardware for s in blind} == {"none", "host"} and {s.hardware for s in loaded if s not in blind} == {
        "nvml"
    }
    assert sum(t.cause == "undetermined" for s in blind for t in s.truths()) >= 6


@pytest.mark.slow  # generates a held-out suite of the same size
def test_a_held_out_suite_has_the_shape_of_the_standard_one_with_other_jobs(tmp_path):
    assert suite_main(["--seed", "7", str(tmp_path)]) == 0
    held_out = load_suite(tmp_path)
    standard = {s.name: s for s in load_suite(STANDARD_SUITE)}
    assert sorted(s.name for s in held_out) == sorted(standard)
    assert all(s.seed != standard[s.name].seed for s in held_out)
    assert sum(s.faults != standard[s.name].faults for s in held_out) > 150
