"""The sink's live page: served on the sink's own connection, with the /query token and tenant rules."""

import http.cookiejar
import importlib.util
import json
import pathlib
import urllib.error
import urllib.request

import pytest

from lockstep.commands.report import live_url
from lockstep.metrics import Metrics
from lockstep.sinks.http import QueryServer, sidecar

spec = importlib.util.spec_from_file_location("store_test", pathlib.Path(__file__).with_name("test_store.py"))
store_test = importlib.util.module_from_spec(spec)
spec.loader.exec_module(store_test)


class Holder:  # what the query server needs of a sink
    def __init__(self, store):
        self.store, self.metrics, self.assigned = store, Metrics("sink"), True


@pytest.fixture
def served(tmp_path):
    path = tmp_path / "f.duckdb"
    store = store_test.two_tenants(path)
    server = QueryServer(Holder(store), path, refresh_s=5).start()
    yield path, server
    server.stop()
    store.close()


def get(url, opener=None, headers=None):
    opener = opener or urllib.request.build_opener()
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=20) as r:
            return r.status, r.read().decode(), r
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), err


def test_the_page_needs_the_token_and_trades_it_for_a_cookie(served):
    path, server = served
    code, body, _ = get(server.url + "/")
    assert code == 401 and "lockstep report --live-url" in body and server._token not in body
    assert get(server.url + "/?token=wrong")[0] == 401

    url = live_url(path)  # what `lockstep report --live-url` prints, from the sink's address file
    assert url.startswith(json.loads(sidecar(path).read_text())["url"])
    jar = http.cookiejar.CookieJar()
    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    code, page, resp = get(url, browser)
    assert code == 200 and resp.url == server.url + "/"  # redirected to the address without the token
    (cookie,) = list(jar)
    assert cookie.has_nonstandard_attr("HttpOnly") and cookie.get_nonstandard_attr("SameSite") == "Strict"
    assert "jb" in page and "ja" in page and 'id="live"' in page and page.count("<script>") == 1
    assert get(server.url + "/", browser)[0] == 200  # the cookie is enough from now on (the page's refreshes)
    assert get(server.url + "/", headers={"Authorization": f"Bearer {server._token}"})[0] == 200
    # /query takes the bearer token only: a page open in a browser does not make its cookie a SQL endpoint
    req = urllib.request.Request(
        server.url + "/query", data=b'{"sql": "SELECT 1"}', headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        browser.open(req, timeout=20)
    assert err.value.code == 401


def test_a_tenants_page_holds_that_tenants_rows_only(served):
    path, server = served
    jar = http.cookiejar.CookieJar()
    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    code, page, resp = get(live_url(path, tenant="globex"), browser)
    assert code == 200 and resp.url == server.url + "/?tenant=globex"
    assert "secret_loader" in page and "gpu_throttle_thermal" not in page and ">ja<" not in page
    code, page, _ = get(server.url + "/?tenant=acme", browser)
    assert "gpu_throttle_thermal" in page and "secret_loader" not in page
