"""The plugin's own ``http_url`` (the address its heartbeats advertise, which a router
routes to and sends its worker key to), checked at start-up by the router's rule
(schemas/worker_url.py). Before, any string passed: a typo (no scheme, a query, a user
and password) started fine, and every router then refused the worker's address
(``drops_total{what="worker_url_refused"}``), leaving it unrouted with nothing said on
the worker's side."""

from __future__ import annotations

import pytest

from kvhint.engine_plugin.config import PluginConfigError, load_plugin_config
from kvhint.router.service.worker_urls import HeartbeatUrlPolicy

# Any host: the plugin checks the form; which hosts a router takes is the router's own.
ANY_HOST = HeartbeatUrlPolicy.from_entries(True, ["*"])

REFUSED = [
    ("gpu-0:8000", "scheme"), ("ftp://gpu-0", "scheme"), ("file:///etc/passwd", "scheme"),
    ("", "scheme"), ("http://w0:s3cret-pw@gpu-0:8000", "user or password"),
    ("http://gpu-0:8000/?a=b", "query"), ("http://gpu-0:8000#x", "query"),
    ("http://", "no host"), ("http://:8000", "no host"), ("http://gpu-0:99999", "unreadable"),
    ("http://gpu-0:8000\r\nX: y", "control"), ("http://gpu-0:8000/\x85", "non-ASCII"),
    ("http://gpu 0:8000", "spaces"), ("http://" + "a" * 3000, "longer"),
]


@pytest.mark.parametrize("url,why", REFUSED)
def test_an_http_url_no_router_would_take_stops_start_up(url: str, why: str) -> None:
    with pytest.raises(PluginConfigError) as err:
        load_plugin_config({"http_url": url})
    says = str(err.value)
    assert "kv_connector_extra_config['http_url']" in says and why in says, says
    assert "s3cret-pw" not in says  # never the value: it may carry a password
    # The same rule as the router's: what the plugin refuses, a router would too.
    refusal = ANY_HOST.refusal(url)
    assert refusal is not None and why in refusal


@pytest.mark.parametrize("url", [
    "http://gpu-0:8000", "https://gpu-0.workers.example.com", "http://10.0.0.5:8000/",
    "http://[fd00::5]:8000", "http://vllm-worker-0.vllm-worker:8000/prefix",
])
def test_an_http_url_a_router_takes_is_accepted(url: str) -> None:
    assert load_plugin_config({"http_url": url}).http_url == url
    assert ANY_HOST.refusal(url) is None


def test_no_http_url_is_still_allowed() -> None:
    assert load_plugin_config({}).http_url is None
