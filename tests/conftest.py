"""Fixtures for real parts: NATS with JetStream, SQLite and PostgreSQL, the tiny model,
and real vLLM OpenAI servers on the CPU.

Markers follow the folder: tests/unit -> unit, tests/integration -> integration,
tests/e2e -> e2e. ``make test`` runs all; ``make test-unit`` runs unit only.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

import pytest

from kvhint.router.devstack.nats_server import (
    NatsServerProcess,
    nats_server_binary,
    running_nats,
    start_nats_on_free_port,
)
from kvhint.router.devstack.ports import START_TRIES, free_port
from kvhint.router.devstack.tiny_model import RECIPE_VERSION, build_tiny_model
from kvhint.router.devstack.vllm_server import VllmServer, VllmWorkerSpec

# Every model the tests load is a local folder; a name the router looks up on the
# Hugging Face hub (a stub worker's "stub") is retried with backoff for ~50 s on a machine
# without internet before it is found unusable. Offline, it fails at once, as it would
# anyway. (vLLM servers the tests start are offline already: devstack/vllm_server.py.)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
# Built artefacts (the tiny model) are reused across runs; set KVHINT_TEST_STATE_DIR to move.
STATE_DIR = Path(os.environ.get("KVHINT_TEST_STATE_DIR", REPO_ROOT / ".kvhint" / "test"))
POSTGRES_HOST = os.environ.get("KVHINT_TEST_PG_HOST", "127.0.0.1")
POSTGRES_PORT = int(os.environ.get("KVHINT_TEST_PG_PORT", "5432"))
POSTGRES_ADMIN_DB = os.environ.get("KVHINT_TEST_PG_DB", "test")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).relative_to(REPO_ROOT / "tests").parts
        if parts and parts[0] in ("unit", "integration", "e2e"):
            item.add_marker(getattr(pytest.mark, parts[0]))


@pytest.fixture(scope="session")
def state_dir() -> Path:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    return STATE_DIR


@pytest.fixture(scope="session")
def tiny_model_dir(state_dir: Path) -> Path:
    return build_tiny_model(state_dir / "models" / RECIPE_VERSION)


# The processor's own chat template: text a tokenizer-template rendering never has.
PROCESSOR_TEMPLATE = ("PROCESSOR{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
                      "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="session")
def processor_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                        ) -> Path:
    """The tiny model with a multimodal processor (LLaVA's, CLIP image processor) whose
    chat template differs from the tokenizer's, as many vision-language models ship."""
    folder = tmp_path_factory.mktemp("processor-model") / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
        "crop_size": {"height": 32, "width": 32}, "size": {"shortest_edge": 32}}))
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "LlavaProcessor", "patch_size": 16, "image_token": "<image>",
        "vision_feature_select_strategy": "default"}))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": PROCESSOR_TEMPLATE}))
    return folder


# --- NATS -----------------------------------------------------------------------------

@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    """The NATS on 127.0.0.1:4222 when it answers, else one started for the session."""
    with running_nats(os.environ.get("KVHINT_TEST_NATS_URL", "nats://127.0.0.1:4222")) as ep:
        yield ep.url


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[NatsServerProcess]:
    """A NATS server this test owns and may stop and start again (same port and store)."""
    server = NatsServerProcess(store_dir=tmp_path / "nats-store", log_path=tmp_path / "nats.log")
    server.start()
    try:
        yield server
    finally:
        server.close()


@dataclass(frozen=True)
class PasswordNats:
    """A NATS server that takes only ``user`` with ``password``; ``url`` has no
    credentials."""

    url: str
    user: str
    password: str


@pytest.fixture
def password_nats(tmp_path: Path) -> Iterator[PasswordNats]:
    """A NATS server (JetStream on) that takes only user kvhint with a password holding
    every character a URL's user info must percent-encode ('/', '#', '?', '@', '%')."""
    user, password = "kvhint", "p/a#s?s@w%rd"
    config = tmp_path / "nats-auth.conf"

    def command(port: int) -> list[str]:
        config.write_text(  # a quoted string in nats.conf: JSON's quoting
            f"listen: 127.0.0.1:{port}\n"
            f"jetstream {{ store_dir: {json.dumps(str(tmp_path / 'nats-auth-store'))} }}\n"
            f"authorization {{ user: {user}, password: {json.dumps(password)} }}\n")
        return [nats_server_binary(), "-c", str(config)]

    server, port = start_nats_on_free_port(command, tmp_path / "nats-auth.log")
    endpoint = PasswordNats(f"nats://127.0.0.1:{port}", user, password)
    try:
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture
def subject_prefix() -> str:
    """A prefix of its own for each test, so tests sharing one NATS never cross."""
    return f"kvhinttest.{uuid.uuid4().hex[:10]}"


# --- Databases ------------------------------------------------------------------------

def _postgres_answers() -> bool:
    try:
        with socket.create_connection((POSTGRES_HOST, POSTGRES_PORT), timeout=1.0):
            return True
    except OSError:
        return False


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database: a SQLite file, or a new PostgreSQL database on
    127.0.0.1:5432 (skipped, with the reason shown, when PostgreSQL is not there)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'kvhint.db'}"
        return
    if not _postgres_answers():
        pytest.skip(f"PostgreSQL not reachable on {POSTGRES_HOST}:{POSTGRES_PORT}; "
                    "the SQLite variant of this test still ran")
    import psycopg

    name = f"kvhint_test_{uuid.uuid4().hex[:12]}"
    admin = f"host={POSTGRES_HOST} port={POSTGRES_PORT} user=postgres dbname={POSTGRES_ADMIN_DB}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@{POSTGRES_HOST}:{POSTGRES_PORT}/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --- vLLM servers ---------------------------------------------------------------------

# Several sessions may share one small machine (2 cores): vLLM servers from different
# pytest sessions would starve each other, so a session holds this lock while it has any.
VLLM_LOCK_PATH = Path(os.environ.get("KVHINT_VLLM_LOCK", "/tmp/kvhint-vllm-servers.lock"))


class VllmServerPool:
    """Starts real vLLM servers on demand and stops every one at session end."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.log_dir = log_dir
        self._servers: list[VllmServer] = []
        self._lock_file: IO[bytes] | None = None

    def _hold_machine_lock(self) -> None:
        if self._lock_file is None:
            self._lock_file = open(VLLM_LOCK_PATH, "ab")
            fcntl.flock(self._lock_file, fcntl.LOCK_EX)

    @property
    def base_spec(self) -> VllmWorkerSpec:
        """The default worker; vary it with ``dataclasses.replace``. Port 0 = pick one."""
        return VllmWorkerSpec(model_dir=self.model_dir, port=0)

    def start(self, name: str, spec: VllmWorkerSpec | None = None) -> VllmServer:
        return self.start_all({name: spec or self.base_spec})[name]

    def start_all(self, specs: dict[str, VllmWorkerSpec]) -> dict[str, VllmServer]:
        """Starts the servers together, then waits for each: their start-ups (imports,
        loading, the engine's set-up) overlap instead of queueing."""
        self._hold_machine_lock()
        servers = {}
        for name, spec in specs.items():
            if "--enforce-eager" not in spec.extra_args:
                # No torch.compile warm-up: ~25 s less per server start on this CPU, and
                # nothing a test checks (the scheduler, KV cache, connector and API
                # server) depends on how the model's forward pass is compiled.
                spec = replace(spec, extra_args=(*spec.extra_args, "--enforce-eager"))
            servers[name] = self._launch(name, spec)
        for name, server in servers.items():
            # A port picked here (spec port 0) may be taken before vLLM binds it: such a
            # start is made again on another port, START_TRIES starts in all.
            for tries_left in range(START_TRIES - 1, -1, -1):
                try:
                    server.wait_ready()
                    break
                except RuntimeError:
                    if not (tries_left and specs[name].port == 0 and server.port_taken()):
                        raise
                    server = servers[name] = self._launch(name, replace(server.spec, port=0))
        return servers

    def _launch(self, name: str, spec: VllmWorkerSpec) -> VllmServer:
        """``spec`` started (port 0: on a port picked here), its server kept to stop."""
        if spec.port == 0:
            spec = replace(spec, port=free_port())
        server = VllmServer(spec, self.log_dir / f"{name}-{spec.port}.log")
        self._servers.append(server)
        server.start()
        return server

    def stop_all(self) -> None:
        for server in reversed(self._servers):
            server.stop()
        self._servers.clear()
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None


@pytest.fixture(scope="session")
def vllm_pool(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[VllmServerPool]:
    pool = VllmServerPool(tiny_model_dir, tmp_path_factory.mktemp("vllm-logs"))
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture(scope="session")
def vllm_server(vllm_pool: VllmServerPool) -> VllmServer:
    """One plain vLLM CPU server (prefix caching, prompt token details), shared."""
    return vllm_pool.start("plain")
