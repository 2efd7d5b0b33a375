"""HeartbeatUrlPolicy (worker_urls.py): which http_url a heartbeat may give a worker the
router is not configured with, and the heartbeat_worker_hosts setting's entries."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvhint.router.service.settings import RouterSettings
from kvhint.router.service.worker_urls import HeartbeatUrlPolicy

DEFAULT = HeartbeatUrlPolicy()


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000", "http://localhost:8000", "http://worker-0:8000",
    "https://10.2.3.4", "http://172.20.0.5:8000/", "http://192.168.1.9:8000/prefix",
    "http://[::1]:8000", "http://[fd00::5]:8000", "http://169.254.1.1:8000",
    "http://WORKER-1:8000", "http://worker-2.:8000"])
def test_the_default_takes_private_network_addresses(url: str) -> None:
    assert DEFAULT.refusal(url) is None


@pytest.mark.parametrize("url,why", [
    ("ftp://10.0.0.1", "scheme"), ("file:///etc/passwd", "scheme"),
    ("javascript:alert(1)", "scheme"), ("10.0.0.1:8000", "scheme"),
    ("http://user:pw@10.0.0.1:8000", "user or password"), ("http://@10.0.0.1", "user"),
    ("http://10.0.0.1:8000?a=b", "query"), ("http://10.0.0.1:8000#x", "query"),
    ("http://10.0.0.1:8000?", "query"), ("http://", "no host"), ("http://:8000", "no host"),
    ("http://10.0.0.1:99999", "unreadable"), ("http://10.0.0.1:8000\r\nX: y", "control"),
    ("http://wörker:8000", "non-ASCII"), ("http://a b:8000", "spaces"),
    ("http://" + "a" * 3000, "longer"), ("http://under%2fscore:8000", "no host name"),
    ("http://8.8.8.8:8000", "not a private"), ("http://203.0.113.7", "not a private"),
    ("http://[::ffff:8.8.8.8]:8000", "not a private"), ("http://0.0.0.0:8000", "not a"),
    ("https://evil.example.com", "not a private"), ("http://100.64.0.1", "not a private")])
def test_the_default_refuses_other_forms_and_public_hosts(url: str, why: str) -> None:
    refusal = DEFAULT.refusal(url)
    assert refusal is not None and why in refusal, refusal


def test_listed_hosts_replace_the_default() -> None:
    policy = HeartbeatUrlPolicy.from_entries(
        True, ["*.vllm-worker", "gpu-7.example.com", "10.8.0.0/16", "fd00::/8", "192.0.2.1"])
    for url in ("http://vllm-worker-2.vllm-worker:8000", "http://GPU-7.example.com.",
                "http://10.8.3.4:8000", "http://[fd00::1]:80", "http://192.0.2.1:8000"):
        assert policy.refusal(url) is None, url
    for url in ("http://vllm-worker", "http://x.vllm-worker.evil.com", "http://worker-0:8000",
                "http://127.0.0.1:8000", "http://10.9.0.1", "http://192.0.2.2",
                "http://evil-gpu-7.example.com", "ftp://gpu-7.example.com"):
        assert policy.refusal(url) is not None, url
    anywhere = HeartbeatUrlPolicy.from_entries(True, ["*"])
    assert anywhere.refusal("https://evil.example.com") is None
    assert anywhere.refusal("gopher://evil.example.com") is not None  # the form, always


def test_learning_off_refuses_every_url() -> None:
    assert HeartbeatUrlPolicy(learn=False).refusal("http://127.0.0.1:8000") is not None


def test_the_setting_parses_a_comma_list_and_refuses_bad_entries() -> None:
    settings = RouterSettings(heartbeat_worker_hosts=" *.Svc , 10.0.0.0/8,gpu-1 ")
    assert settings.heartbeat_worker_hosts == ["*.svc", "10.0.0.0/8", "gpu-1"]
    assert RouterSettings(heartbeat_worker_hosts="10.1.2.3").heartbeat_worker_hosts == [
        "10.1.2.3/32"]
    for bad in ("10.0.0.0/33", "http://x", "*.", "a b", "x/y"):
        with pytest.raises(ValidationError, match="heartbeat_worker_hosts"):
            RouterSettings(heartbeat_worker_hosts=bad)
