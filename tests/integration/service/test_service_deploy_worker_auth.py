"""The worker API key as deploy/kubernetes gives it, against vLLM 0.32's real HTTP app:
vLLM reads the key from ``VLLM_API_KEY`` (the workers' command line holds none) and then
refuses ``/v1`` without it; the router's real client, with ``worker_api_key`` from the
same Secret, gets through; ``/metrics`` stays open, so Prometheus's key-less scrape
keeps working; ``/invocations`` and ``/tokenize`` stay open, the caveat deploy/README.md
documents (if a vLLM upgrade guards them, this says the docs are stale).

vLLM's app is built as ``vllm serve`` builds it (its argument parser, ``build_app``) and
served in a subprocess with the worker container's environment, but with no engine
behind it: an engine start costs tens of seconds of the suite's 2 cores, and the key is
checked by a middleware in front of every route. A request let through therefore fails
in the route itself (500, no engine), which is distinct from the middleware's 401."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from kvhint.router.devstack.ports import PortTaken, on_free_port, says_port_taken
from kvhint.router.service.upstream import UpstreamPool, UpstreamUnavailable

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
KEY = "wk-0p3r/at+r=$x"  # an operator's, in the Secret
# vLLM's HTTP app as `vllm serve` builds it (argv: the server's arguments), with no
# engine, served on the port given.
_SERVE = """
import json, sys
import uvicorn
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
assert args.api_key is None, "a key on the command line"
uvicorn.run(build_app(args, ("generate",)), host="127.0.0.1", port=int(sys.argv[2]),
            lifespan="off", log_level="warning")
"""


def _container_env(workload: str, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The variables a workload's container gets from Secrets (secretKeyRef)."""
    docs = [doc for path in sorted((DEPLOY / "kubernetes").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]
    (workload_doc,) = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")
                       and d["metadata"]["name"] == workload]
    (container,) = workload_doc["spec"]["template"]["spec"]["containers"]
    env = {}
    for variable in container.get("env", []):
        if ref := variable.get("valueFrom", {}).get("secretKeyRef"):
            env[variable["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def _secrets() -> dict[str, dict[str, str]]:
    """The shipped Secrets, the worker key replaced by an operator's."""
    docs = [doc for path in sorted((DEPLOY / "kubernetes").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]
    secrets = {d["metadata"]["name"]: dict(d["stringData"]) for d in docs
               if d["kind"] == "Secret"}
    secrets["kvhint-worker-api-key"]["api-key"] = KEY
    return secrets


@pytest.fixture(scope="module")
def keyed_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM's app with the worker container's Secret-given environment; its URL. Its log
    goes to a file (a pipe nobody reads would fill with the routes' tracebacks)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("VLLM_")}
    env |= _container_env("vllm-worker", _secrets())
    env |= {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    assert env["VLLM_API_KEY"] == KEY
    log_path = tmp_path_factory.mktemp("keyed-vllm") / "vllm.log"

    def start(port: int) -> tuple[subprocess.Popen[bytes], str]:
        """Started on ``port``, answering; PortTaken (another try) when it was taken."""
        with open(log_path, "wb") as log:
            server = subprocess.Popen([sys.executable, "-c", _SERVE, '["--model", "m"]',
                                       str(port)], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            if server.poll() is not None:
                with open(log_path, "rb") as log:
                    if says_port_taken(log):
                        raise PortTaken(f"port {port} taken")
                raise RuntimeError(f"vLLM's app exited: {log_path.read_text()[-2000:]}")
            try:
                httpx.get(f"{url}/version", timeout=2)
                return server, url
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    server.kill()
                    raise
                time.sleep(0.2)

    server, url = on_free_port(start)
    try:
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


async def _models_status(url: str, key: str | None) -> int:
    """The status vLLM answers the router's real client's GET /v1/models (its
    ``get_json`` raises on any failed status, which is all a keyless engine answers)."""
    from pydantic import SecretStr

    pool = UpstreamPool(3.0, 30.0, SecretStr(key) if key is not None else None,
                        keepalive_s=4.0)
    await pool.start()
    try:
        await pool.get_json(f"{url}/v1/models", 10.0, worker_id="w0")
    except UpstreamUnavailable as refused:
        assert refused.status is not None, refused
        return refused.status
    finally:
        await pool.close()
    return 200


async def test_vllm_requires_the_secret_key_and_the_router_sends_it(keyed_vllm: str) -> None:
    router_key = _container_env("kvhint-router", _secrets())["KVHINT_ROUTER_WORKER_API_KEY"]
    assert await _models_status(keyed_vllm, None) == 401
    assert await _models_status(keyed_vllm, "another-key") == 401
    # Let through: the route itself answers (500: no engine behind this app).
    assert await _models_status(keyed_vllm, router_key) not in (401, 403)
    async with httpx.AsyncClient(base_url=keyed_vllm) as client:
        chat = await client.post("/v1/chat/completions", json={"model": "m", "messages": []})
        assert chat.status_code == 401


async def test_vllm_leaves_metrics_and_the_documented_paths_open(keyed_vllm: str) -> None:
    async with httpx.AsyncClient(base_url=keyed_vllm) as client:
        metrics = await client.get("/metrics")  # Prometheus's scrape, with no key
        assert metrics.status_code == 200
        assert "# TYPE" in metrics.text
    # deploy/README.md's caveat: not guarded by the key in vLLM 0.32. A client each: the
    # server closes a connection after a route's unhandled error (no engine here).
    for path in ("/invocations", "/tokenize"):
        async with httpx.AsyncClient(base_url=keyed_vllm) as client:
            answer = await client.post(path, json={})
        assert answer.status_code != 401, (path, answer.status_code)
    readme = (DEPLOY / "README.md").read_text()
    assert "`/invocations`" in readme and "`/tokenize`" in readme and "`/metrics`" in readme
