"""NATS does not start with the public placeholder password (or an empty one, or one
nats.conf cannot take).

Before, the router and the plugin refused a ``change-me...`` NATS password, but NATS itself
started with Kubernetes' shipped ``change-me-nats`` (and compose's NATS with any
placeholder an operator typed) and took clients with it. Now deploy/nats-check-password.sh
runs first (the StatefulSet's init container, from ConfigMap kvhint-nats-check; compose's
NATS entrypoint, which then execs nats-server) and exits non-zero with a message naming
what to replace, never the password. Its prefix is the code's PLACEHOLDER_SECRET_PREFIX:
the script is run here with sh on both sides of it."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy_manifests import DEPLOY, POSIX_SHELLS, compose_mounts, interpolated, \
    k8s_config_map, k8s_container, k8s_env, k8s_secrets, k8s_workload, run_start
from kvhint.schemas.nats_address import PLACEHOLDER_SECRET_PREFIX, is_placeholder_secret

SCRIPT = DEPLOY / "nats-check-password.sh"
_SHELLS = POSIX_SHELLS
_PINNED_BUSYBOX = re.compile(r"busybox:\d+\.\d+\.\d+")
_REAL = ["pw-from-env_1.x", "-1234", "true", "change-mx", "xchange-me", "0change-me",
         "p/a#s?s@w%rd,x", "it's $HOME; a b"]
# nats.conf reads the password in double quotes: a '"' ends it, a backslash escapes
# (NATS refused to start, or took "a\tb" as a tab).
_UNQUOTABLE = ['pw"x', "pw\\x", "a\\tb"]
_REFUSED = [PLACEHOLDER_SECRET_PREFIX, f"{PLACEHOLDER_SECRET_PREFIX}-nats",
            f"{PLACEHOLDER_SECRET_PREFIX.upper()}-Secret_1", "", *_UNQUOTABLE]


def _check(script: Path, env: dict[str, str], shell: list[str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    """The check as a container runs it: ``sh <file>`` with the container's environment."""
    return subprocess.run([*(shell or ["sh"]), str(script)], env={"PATH": os.defpath} | env,
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("shell", _SHELLS, ids=lambda shell: Path(shell[0]).name)
@pytest.mark.parametrize("password", _REFUSED + _REAL + [None])
def test_the_check_refuses_what_the_router_and_plugin_refuse_and_nats_conf_cannot_take(
        shell: list[str], password: str | None) -> None:
    env = {} if password is None else {"NATS_PASSWORD": password}
    done = _check(SCRIPT, env, shell)
    unquotable = password in _UNQUOTABLE
    refused = not password or is_placeholder_secret(password) or unquotable
    assert (done.returncode != 0) == refused, done.stderr
    if refused:
        assert "refusing to start NATS" in done.stderr
        assert ("double quote or a backslash" if unquotable else "placeholder" if password
                else "empty") in done.stderr
        assert "Secret kvhint-nats" in done.stderr and "KVHINT_NATS_PASSWORD" in done.stderr
    if password and len(password) > len(PLACEHOLDER_SECRET_PREFIX):
        assert password not in done.stdout + done.stderr  # never echoes the secret


def test_the_scripts_prefix_is_the_codes() -> None:
    (prefix,) = re.findall(r"^prefix=(\S+)$", SCRIPT.read_text(), re.M)
    assert prefix == PLACEHOLDER_SECRET_PREFIX


def test_kubernetes_nats_runs_the_check_before_it_starts(tmp_path: Path) -> None:
    """The StatefulSet's init container runs the same script, from a ConfigMap, with the
    password NATS gets from Secret kvhint-nats, never on its command line; the shipped
    Secret is refused, a replaced password starts."""
    pod = k8s_workload("kvhint-nats")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert _PINNED_BUSYBOX.fullmatch(init["image"]), init["image"]
    shell, path = init["command"]
    assert shell == "sh" and "args" not in init
    assert "NATS_PASSWORD" not in json.dumps(init["command"])  # ps would show it
    (mount,) = [m for m in init["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    text = k8s_config_map(volume["configMap"]["name"])["data"][Path(path).name]
    assert text == SCRIPT.read_text()
    script = tmp_path / Path(path).name
    script.write_text(text)

    def ref(container: dict) -> dict:
        (variable,) = [v for v in container["env"] if v["name"] == "NATS_PASSWORD"]
        return variable["valueFrom"]["secretKeyRef"]
    assert ref(init) == ref(k8s_container("kvhint-nats"))

    secrets = k8s_secrets()
    refused = _check(script, k8s_env(init, secrets))  # the Secret as shipped
    assert refused.returncode != 0 and "placeholder" in refused.stderr
    secrets["kvhint-nats"]["password"] = "pw-from-secret_2.y"
    assert _check(script, k8s_env(init, secrets)).returncode == 0


@pytest.mark.parametrize("password", [f"{PLACEHOLDER_SECRET_PREFIX}-nats", 'pw"x',
                                      "pw-from-env_1.x"])
def test_compose_nats_runs_the_check_then_becomes_nats_server(password: str,
                                                              tmp_path: Path) -> None:
    """compose's NATS runs the check as its entrypoint, with KVHINT_NATS_PASSWORD, and the
    check execs nats-server's command once it passed. Before, the check was a service of
    its own that exited 0 (NATS waited for it to complete): `docker compose up
    --abort-on-container-exit` stopped the whole stack as soon as it had. Now no service
    waits for another to complete (none is a one-shot)."""
    env = {"KVHINT_ADMIN_KEY": "adm", "KVHINT_NATS_PASSWORD": password,
           "KVHINT_WORKER_API_KEY": "wk"}
    services = yaml.safe_load(interpolated((DEPLOY / "compose.yaml").read_text(), env))[
        "services"]
    for name, service in services.items():
        conditions = service.get("depends_on", {})
        assert "service_completed_successfully" not in str(conditions), name
    nats = services["nats"]
    shell, path = nats["entrypoint"]
    assert shell == "sh" and compose_mounts(nats)[path] == SCRIPT
    assert nats["image"].startswith("nats:") and nats["image"].endswith("-alpine")  # a sh
    start = [*nats["entrypoint"], *nats["command"]]
    if is_placeholder_secret(password) or '"' in password:
        done = _check(SCRIPT, nats["environment"])
        assert done.returncode != 0 and "refusing to start NATS" in done.stderr
        with pytest.raises(AssertionError, match="refusing to start NATS"):
            run_start(start, nats["environment"], compose_mounts(nats), ["nats-server"],
                      tmp_path)
        return
    started = run_start(start, nats["environment"], compose_mounts(nats), ["nats-server"],
                        tmp_path)
    assert started["program"] == "nats-server"  # execed: the container's process
    # nats-server with the mounted nats.conf (here, the local copy it reads).
    assert started["argv"] == ["-c", str(DEPLOY / "nats.conf")]
