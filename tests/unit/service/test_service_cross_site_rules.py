"""What a page on another site can make a browser send to a state-changing endpoint is
refused; what API clients and the router's own dashboard send is not (cross_site.py)."""

from __future__ import annotations

import pytest

from kvhint.router.service.cross_site import cross_site_reason, cross_site_refusal
from kvhint.router.service.metric_labels import CROSS_SITE_ENDPOINTS, CROSS_SITE_REASONS
from kvhint.router.service.metrics import RouterMetrics

FORM = "application/x-www-form-urlencoded"


@pytest.mark.parametrize(("method", "headers", "reason"), [
    # An HTML form on another site: modern browser, then one without Sec-Fetch-Site.
    ("POST", {"content-type": FORM, "origin": "https://evil.example",
              "sec-fetch-site": "cross-site"}, "cross_site"),
    ("POST", {"content-type": FORM, "origin": "https://evil.example"}, "no_marker"),
    ("POST", {"content-type": "multipart/form-data; boundary=x"}, "no_marker"),
    # enctype="text/plain" with a JSON-looking body: still not a JSON content type.
    ("POST", {"content-type": "text/plain"}, "no_marker"),
    # A no-cors fetch without a body sends no content type at all.
    ("POST", {}, "no_marker"),
    # Another port of the same host is same-site, not same-origin.
    ("POST", {"sec-fetch-site": "same-site", "x-kvhint-request": "1"}, "cross_site"),
    # Whatever it carries, a browser says it came from elsewhere.
    ("DELETE", {"sec-fetch-site": "cross-site", "authorization": "Bearer k"}, "cross_site"),
    ("POST", {"sec-fetch-site": "Cross-Site ", "content-type": "application/json"},
     "cross_site"),
    # The dashboard's own (same-origin, X-Kvhint-Request), with or without a key.
    ("POST", {"sec-fetch-site": "same-origin", "x-kvhint-request": "dashboard"}, None),
    ("POST", {"sec-fetch-site": "same-origin", "x-kvhint-request": "dashboard",
              "authorization": "Bearer k"}, None),
    # curl and SDKs: a key (curl -d sends a form content type), or JSON, or the header.
    ("POST", {"authorization": "Bearer k", "content-type": FORM}, None),
    ("POST", {"x-api-key": "k"}, None),
    ("POST", {"content-type": "application/json; charset=utf-8"}, None),
    ("POST", {"x-kvhint-request": "1"}, None),
    # DELETE is preflighted by itself; reads change nothing.
    ("DELETE", {}, None),
    ("GET", {"sec-fetch-site": "cross-site"}, None),
])
def test_what_is_refused(method: str, headers: dict[str, str], reason: str | None) -> None:
    assert cross_site_reason(method, headers) == reason


def test_a_refusal_is_counted_by_endpoint_and_reason_and_echoes_nothing() -> None:
    metrics = RouterMetrics()
    message = cross_site_refusal("POST", {"content-type": FORM, "authorization": "",
                                          "origin": "https://evil.example"},
                                 metrics, "admin")
    assert message is not None and "X-Kvhint-Request" in message
    assert "evil" not in message
    assert cross_site_refusal("POST", {"x-kvhint-request": "1"}, metrics, "admin") is None
    counted = {(s.labels["endpoint"], s.labels["reason"]): s.value
               for family in metrics.cross_site_refusals.collect() for s in family.samples
               if s.name.endswith("_total")}
    assert counted[("admin", "no_marker")] == 1
    assert sum(counted.values()) == 1  # every series, at 0 if unused:
    assert len(counted) == len(CROSS_SITE_ENDPOINTS) * len(CROSS_SITE_REASONS) == 8
