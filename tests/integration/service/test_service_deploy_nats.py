"""The shipped NATS configuration, run by the real nats-server: compose's (deploy/nats.conf
with the environment compose.yaml gives the container) and Kubernetes' (the ConfigMap's
nats.conf with the environment the StatefulSet builds from Secret kvhint-nats).

Security review: NATS took its password as ``--pass`` on the command line, which ``ps``
and /proc/PID/cmdline show. Now it starts with ``-c nats.conf`` only and the file reads
the password from the environment; JetStream, the store and the monitor port are as
before (``-js -sd /data -m 8222``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nats
import pytest
import yaml
from nats.errors import Error as NatsError

from kvhint.router.devstack.nats_server import nats_server_binary, start_nats_on_free_port
from kvhint.router.devstack.ports import free_port
from kvhint.schemas.nats_address import nats_connection

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
_K8S_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _compose_nats(password: str) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """compose's NATS: its start (entrypoint and command: the password check, which
    execs nats-server), its environment (``${VAR:?...}`` filled with the password) and its
    mounted files (container path -> text)."""
    def filled(value: object) -> object:  # compose interpolates the parsed values
        if isinstance(value, str):
            return re.sub(r"\$\{KVHINT_NATS_PASSWORD:\?[^}]*\}", lambda _: password, value)
        if isinstance(value, list):
            return [filled(item) for item in value]
        if isinstance(value, dict):
            return {key: filled(item) for key, item in value.items()}
        return value
    nats_service = filled(yaml.safe_load((DEPLOY / "compose.yaml").read_text())[
        "services"]["nats"])
    files = {}
    for volume in nats_service["volumes"]:
        source, _, target = volume.partition(":")
        if source.startswith("./"):
            files[target.split(":")[0]] = (DEPLOY / source).read_text()
    return ([*nats_service["entrypoint"], *nats_service["command"]],
            {"PATH": os.defpath, **nats_service.get("environment", {})}, files)


def _k8s_nats(password: str) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """The Kubernetes NATS: its arguments, its environment (the Secret's password, as an
    operator sets it, and ``$(VAR)`` of variables listed before) and its ConfigMap's
    files (container path -> text)."""
    docs = [doc for doc in yaml.safe_load_all((DEPLOY / "kubernetes" / "nats.yaml").read_text())
            if doc]
    named = {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}
    secret = dict(named["Secret", "kvhint-nats"]["stringData"], password=password)
    pod = named["StatefulSet", "kvhint-nats"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env: dict[str, str] = {}
    for variable in container["env"]:
        if "valueFrom" in variable:
            ref = variable["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "kvhint-nats", ref
            env[variable["name"]] = secret[ref["key"]]
        else:
            env[variable["name"]] = _K8S_REFERENCE.sub(
                lambda m: env.get(m.group(1), m.group(0)), variable["value"])
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    files = {}
    for volume in pod.get("volumes", []):
        # The init container's check script is no file of NATS's.
        if "configMap" in volume and volume["name"] in mounts:
            data = named["ConfigMap", volume["configMap"]["name"]]["data"]
            files.update({f"{mounts[volume['name']]}/{key}": text for key, text in data.items()})
    args = [_K8S_REFERENCE.sub(lambda m: env.get(m.group(1), m.group(0)), arg)
            for arg in container.get("command", []) + container["args"]]
    return ["nats-server", *args], env, files  # the image's entrypoint, then its args


def _local(text: str, store: Path, port: int, monitor: int) -> str:
    """The shipped config with this machine's store and free ports; each shipped value
    (4222, 8222, /data) must be there once, so the rewrite checks them too. The monitor
    listens on `host`, like the clients."""
    for shipped, local in ((r"^port: 4222$", f"host: 127.0.0.1\nport: {port}"),
                           (r"^http_port: 8222$", f"http_port: {monitor}"),
                           (r"^(\s*)store_dir: /data$", rf"\g<1>store_dir: {store}")):
        text, count = re.subn(shipped, local, text, flags=re.M)
        assert count == 1, shipped
    return text


@contextmanager
def _nats_server(args: list[str], env: dict[str, str], files: dict[str, str],
                 tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, str]]:
    """The real nats-server started with the shipped start (``nats-server`` in it: the
    binary here), arguments and environment, each mounted file a local copy (nats.conf
    ``_local``); yields it, its client URL (no credentials) and its monitor URL."""
    monitors: list[int] = []

    def command(port: int) -> list[str]:  # each try: its ports, taken or not, replaced
        monitors.append(free_port())
        local_args = [nats_server_binary() if arg == "nats-server" else arg for arg in args]
        for path, text in files.items():
            copy = tmp_path / Path(path).name
            copy.write_text(_local(text, tmp_path / "store", port, monitors[-1])
                            if copy.name == "nats.conf" else text)
            local_args = [str(copy) if arg == path else arg for arg in local_args]
        assert str(tmp_path / "nats.conf") in local_args, "NATS reads no mounted nats.conf"
        return local_args

    server, port = start_nats_on_free_port(command, tmp_path / "nats.log", env)
    try:
        yield server, f"nats://127.0.0.1:{port}", f"http://127.0.0.1:{monitors[-1]}"
    finally:
        server.terminate()
        server.wait(timeout=10)


async def _refused(url: str, **credentials: str) -> bool:
    try:
        client = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0,
                                    connect_timeout=2, **credentials)
    except NatsError as exc:
        return "authorization violation" in str(exc).lower()
    await client.close()
    return False


# A password of letters, digits, "-", "_" and "." (once the only ones the deploy files
# allowed), two that nats-server would read as a number and a boolean without the quotes
# nats.conf asks for, and ones holding what a URL's user info must percent-encode and a
# shell or nats.conf might read (the router and the plugin get them through
# nats-url-env.sh: connected with below).
@pytest.mark.parametrize("password", ["pw-from-env_1.x", "-1234", "true", "p/a#s?s@w%rd,x",
                                      "it's $HOME; a b {}"])
@pytest.mark.parametrize("shipped", [_compose_nats, _k8s_nats], ids=["compose", "kubernetes"])
async def test_the_shipped_nats_takes_its_password_from_its_environment(
        shipped, password: str, tmp_path: Path) -> None:
    args, env, files = shipped(password)
    with _nats_server(args, env, files, tmp_path) as (server, url, monitor):
        # What ps shows (a server that died would show nothing: it must be this one).
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[0].endswith(b"nats-server") and b"-c" in cmdline, cmdline
        assert password.encode() not in b" ".join(cmdline)
        assert not {b"--pass", b"--user", b"--auth"} & set(cmdline)

        # As the router and the plugin connect: the URL nats-url-env.sh builds, decoded.
        connection = nats_connection(_client_url(url, password, tmp_path))
        client = await nats.connect(list(connection.servers), user=connection.user,
                                    password=connection.password,
                                    allow_reconnect=False, max_reconnect_attempts=0)
        try:
            info = await client.jetstream().account_info()  # JetStream answers
            assert info.limits is not None
        finally:
            await client.close()
        assert await _refused(url, user="kvhint", password=password + "x")
        assert await _refused(url, user="other", password=password)
        assert await _refused(url)

        # Monitoring: the readiness probe's /healthz, and JetStream's store as configured.
        with urllib.request.urlopen(f"{monitor}/healthz", timeout=5) as answer:
            assert json.load(answer) == {"status": "ok"}
        with urllib.request.urlopen(f"{monitor}/varz", timeout=5) as answer:
            varz = json.load(answer)
        assert varz["jetstream"]["config"]["store_dir"] == str(tmp_path / "store" / "jetstream")
        assert varz["auth_required"] is True and varz["http_host"] == "127.0.0.1"


def _client_url(server: str, password: str, tmp_path: Path) -> str:
    """The URL deploy/nats-url-env.sh gives a client of ``server`` with ``password``."""
    done = subprocess.run(["sh", str(DEPLOY / "nats-url-env.sh"), "URL", server, "sh", "-c",
                           'printf %s "$URL"'], env={"PATH": os.defpath,
                                                     "KVHINT_NATS_PASSWORD": password},
                          capture_output=True, text=True, timeout=30, check=True)
    return done.stdout


def test_compose_and_kubernetes_ship_the_same_nats_conf() -> None:
    compose = _compose_nats("pw")[2]["/etc/nats/nats.conf"]
    (k8s,) = _k8s_nats("pw")[2].values()
    assert compose == k8s
