"""The routes file: validated at start-up, every mistake named."""

import base64
import os

import pytest

from lockstep.sinks.paging import routes

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()


def test_routes_file_is_validated_at_start_up(tmp_path):
    good = {"routes": [{"name": "pd", "type": "pagerduty", "routing_key_env": "PD_KEY"}]}
    assert routes.parse(good, {"PD_KEY": "x"}).routes[0].url == routes.PAGERDUTY_EVENTS_URL
    cases = [
        (good, {}, "environment variable PD_KEY"),
        ({"routes": [{"name": "x", "type": "email"}]}, {}, "type"),
        ({"routes": [{"name": "x", "type": "slack", "url": "https://h", "colour": "red"}]}, {}, "colour"),
        (
            {"routes": [{"name": "x", "type": "slack", "url": "https://h", "match": {"causes": ["meteor"]}}]},
            {},
            "meteor",
        ),
        (
            {"routes": [{"name": "x", "type": "webhook", "url": "https://h", "secret_env": "S"}]},
            {"S": "whsec_c2hvcnQ="},
            "24 to 64 bytes",
        ),
        (
            {"routes": [{"name": "x", "type": "webhook", "url": "ftp://h", "secret_env": "S"}]},
            {"S": SECRET},
            r"http\(s\) url",
        ),
        ({"routes": [{"name": "x", "type": "slack", "url": "https://h"}] * 2}, {}, "unique"),
        ({"routes": [], "retry": {"max_attempts": 0}}, {}, "max_attempts"),
    ]
    for data, env, needle in cases:
        with pytest.raises(routes.RoutesError, match=needle):
            routes.parse(data, env)
    # every cause a finding can carry is one a route can match on, the undetermined ones included
    assert routes.parse(
        {
            "routes": [
                {"name": "x", "type": "slack", "url": "https://h", "match": {"causes": ["undetermined", "unknown"]}}
            ]
        },
        {},
    )
    path = tmp_path / "routes.yaml"
    path.write_text("routes: [{name: pd, type: pagerduty, routing_key_env: LOCKSTEP_TEST_PD}]\n")
    with pytest.raises(routes.RoutesError, match="LOCKSTEP_TEST_PD"):
        routes.load(path, env={k: v for k, v in os.environ.items() if k != "LOCKSTEP_TEST_PD"})
