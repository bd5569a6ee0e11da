import pytest

from lockstep.streams.policy import Policy, PolicyError, PolicyFile, load_policy


def test_default_policy_has_a_stable_hash():
    assert Policy().hash == Policy().hash
    assert Policy().ref.startswith("default@")


def test_policy_file_overrides_and_changes_the_hash(tmp_path):
    p = tmp_path / "strict.yaml"
    p.write_text("id: strict\ndetector:\n  slowdown_threshold: 0.05\ndiagnosis:\n  peer_group_keys: [pp, tp]\n")
    pol = load_policy(p)
    assert pol.id == "strict"
    assert pol.detector.slowdown_threshold == 0.05
    assert pol.diagnosis.peer_group_keys == ("pp", "tp")
    assert pol.hash != Policy().hash


@pytest.mark.parametrize(
    "text,needle",
    [
        ("detector:\n  slowdown_treshold: 0.1\n", "slowdown_treshold: unknown key"),
        ("detector:\n  window_steps: eight\n", "window_steps"),
        ("diagnosis:\n  persistence: 2.0\n", "persistence"),
        ("diagnosis:\n  link_steady_ratio: 1.5\n", "link_steady_ratio must be in"),
        ("diagnosis:\n  link_min_samples: 1\n", "link_min_samples must be >= 2"),
        ("diagnosis:\n  ratio_peers_max: 1\n", "ratio_peers_max must be >= 2"),
        ("diagnosis:\n  ratio_rise: 0\n", "ratio_rise must be > 0"),
        ("colour: red\n", "unknown key"),
        ("[1, 2", "not valid YAML"),
    ],
)
def test_bad_policy_files_are_rejected_in_one_line(tmp_path, text, needle):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(PolicyError) as exc:
        load_policy(p)
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("detector:\n  hang_factor: 0.5\n", "detector.hang_factor must be > 1, got 0.5"),
        ("detector:\n  max_windows_fleet: 0\n", "detector.max_windows_fleet must be >= 1"),
        ("detector:\n  record_shapes: 'yes'\n", "record_shapes: 'yes' is not valid: expected true or false"),
        ("detector:\n  window_steps: 100\n", "exceeds detector.max_window_steps"),
        ("jobs:\n  include: train-*\n", "jobs.include: 'train-*' is not valid: expected a list of strings"),
        ("jobs:\n  tenant: [a]\n", "jobs.tenant: unknown key"),
        ("version: two\n", "version 'two' is not valid"),
        ("detector:\n  rule: ewma\n", "detector.rule must be one of cusum, median, got 'ewma'"),
        ("detector:\n  rule: 1\n", "detector.rule: 1 is not valid: expected a string"),
        ("detector:\n  spread_floor: 0\n", "detector.spread_floor must be in (0, 1), got 0.0"),
        ("detector:\n  cusum_h: 0\n", "detector.cusum_h must be > 0"),
        ("detector:\n  periodic_min_gap: 1\n", "detector.periodic_min_gap must be 0 (off) or >= 2, got 1"),
        (
            "detector:\n  baseline_steps: 50\n  reference_steps: 40\n",
            "detector.baseline_steps (50) exceeds detector.reference_steps (40)",
        ),
    ],
)
def test_bad_detector_and_selector_values_are_named(tmp_path, text, needle):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(PolicyError) as exc:
        load_policy(p)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_selectors_and_sampling_load(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text(
        "jobs: {include: ['train-*'], exclude: ['*-test'], tenants: [acme]}\n"
        "detector: {hardware_hz: 50, with_stack: true, hang_min_s: 5}\n"
    )
    pol = load_policy(p)
    assert pol.jobs.matches("train-7", "acme")
    assert not pol.jobs.matches("train-7-test", "acme") and not pol.jobs.matches("train-7", "other")
    assert not pol.jobs.matches("eval", "acme")
    assert (pol.detector.hardware_hz, pol.detector.with_stack, pol.detector.hang_min_s) == (50.0, True, 5.0)
    assert Policy().jobs.matches("anything", "")


def test_policy_file_reloads_on_change_and_keeps_the_old_one_when_broken(tmp_path, caplog):
    p = tmp_path / "p.yaml"
    p.write_text("id: one\ndetector: {slowdown_threshold: 0.2}\n")
    source = PolicyFile(p)
    first = source.policy
    assert source.check() is None  # unchanged
    p.write_text("id: one\ndetector: {slowdown_threshold: 0.2, hang_factor: 0}\n")
    with caplog.at_level("ERROR", logger="lockstep.policy"):
        assert source.check() is None
        assert source.check() is None  # one error per change of the file, not per check
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "hang_factor must be > 1" in errors[0] and f"keeping policy {first.ref}" in errors[0]
    assert source.policy is first
    p.write_text("id: one\ndetector: {slowdown_threshold: 0.05}\n")
    new = source.check()
    assert new is not None and new.detector.slowdown_threshold == 0.05 and new.hash != first.hash
    assert source.policy is new
    p.unlink()
    assert source.check() is None and source.policy is new  # a deleted file keeps the policy too


def test_a_reload_applies_to_the_detector_and_the_diagnosis():
    from lockstep.kafka import Topics
    from lockstep.streams.policy import DetectorPolicy, DiagnosisPolicy
    from lockstep.streams.stages import MemoryOutput, Processor, Tables

    old = Policy()
    proc = Processor(old, Topics.named(), MemoryOutput(), Tables(), step_timeout_s=1.0, window_timeout_s=1.0)
    new = Policy(id="new", detector=DetectorPolicy(slowdown_threshold=0.05), diagnosis=DiagnosisPolicy(z_threshold=6.0))
    proc.set_policy(new)
    assert proc.detect.detector.policy is new and proc.policies.current is new
    # a window opened under the old policy is judged under it; new windows under the new one
    assert proc.policies.for_ref(old.ref) is old and proc.policies.for_ref(new.ref) is new
    assert proc.policies.for_ref("unknown@123") is new
    assert 'lockstep_policy_info{policy="' + new.ref + '"} 1' in proc.metrics.render()
