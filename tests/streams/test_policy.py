import pytest

from lockstep.streams.policy import Policy, PolicyError, load_policy


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
