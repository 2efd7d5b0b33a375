"""deploy/nats-url-env.sh, which starts the router and the workers (compose's entrypoint;
Kubernetes' command, from ConfigMap kvhint-nats-client), puts NATS's URL in their
environment with user kvhint and KVHINT_NATS_PASSWORD percent-encoded, so any password
works: the router and the plugin decode it (schemas/nats_address.py).

Before, compose and the manifests wrote the raw password into the URL: a '/', '#' or '?'
ended its user info early (the URL refused, or read as another host), a '@' or '%'
changed the password read, a ',' split the server list; the deploy files allowed
letters, digits, '-', '_' and '.' only. The script runs here with every POSIX shell at
hand (the images' sh is dash or busybox), the server it starts a stand-in.
(test_service_deploy_files.py runs compose's and Kubernetes' starts through it.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from deploy_manifests import DEPLOY, POSIX_SHELLS, run_start

from kvhint.schemas.nats_address import NatsConnection, nats_connection, nats_url_problem

SCRIPT = DEPLOY / "nats-url-env.sh"
_PASSWORDS = ["p/a#s?s@w%rd,x", "pw-from-env_1.x", "%2F%", "it's $HOME; a b", "é€-1234",
              'q"b\\s']


@pytest.mark.parametrize("shell", POSIX_SHELLS, ids=lambda shell: Path(shell[0]).name)
@pytest.mark.parametrize("password", _PASSWORDS)
def test_the_url_carries_the_password_percent_encoded(shell: list[str], password: str,
                                                      tmp_path: Path) -> None:
    started = run_start([*shell, str(SCRIPT), "SOME_NATS_URL", "nats://nats:4222",
                         "server", "--flag", "two words"],
                        {"KVHINT_NATS_PASSWORD": password}, {}, ["server"], tmp_path)
    assert started["argv"] == ["--flag", "two words"]  # the command, as given
    url = started["env"]["SOME_NATS_URL"]
    assert password not in url  # never raw, whatever it holds
    assert nats_url_problem(url) is None
    # What the router and the plugin connect with: the server, user kvhint, the password.
    assert nats_connection(url) == NatsConnection(("nats://nats:4222",), user="kvhint",
                                                  password=password)


def _refusal(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(SCRIPT), *args], env={"PATH": os.defpath, **env},
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("args, env, says", [
    (["V", "nats://nats:4222", "true"], {}, "password is empty"),
    (["V", "nats://nats:4222", "true"], {"KVHINT_NATS_PASSWORD": ""}, "password is empty"),
    (["1V", "nats://nats:4222", "true"], {"KVHINT_NATS_PASSWORD": "pw"}, "variable"),
    (["V", "nats://u:p@nats:4222", "true"], {"KVHINT_NATS_PASSWORD": "pw"}, "credentials"),
    (["V", "nats://a:4222,nats://b:4222", "true"], {"KVHINT_NATS_PASSWORD": "pw"}, "one"),
    (["V", "nats:4222", "true"], {"KVHINT_NATS_PASSWORD": "pw"}, "as a URL"),
    (["V", "nats://nats:4222"], {"KVHINT_NATS_PASSWORD": "pw"}, "usage"),
])
def test_what_it_cannot_start_with_is_said_and_nothing_runs(
        args: list[str], env: dict[str, str], says: str) -> None:
    done = _refusal(args, env)
    assert done.returncode != 0 and says in done.stderr, done.stderr
    assert "pw" not in done.stderr.replace("password", "")  # never shows the password
