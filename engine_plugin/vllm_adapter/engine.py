"""Engine-level touches: the engine's wake-up, connector registration by name, the
NONE_HASH seed, the connector's role, and encoding events as vLLM's own KVEventBatch."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import msgspec


class EventBatchEncoder:
    """Encodes drained events as vLLM's own msgpack ``KVEventBatch`` (byte for byte what
    vLLM's publisher sends). One per thread."""

    def __init__(self) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self._batch_type = KVEventBatch
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, ts: float, events: list[Any], data_parallel_rank: int | None) -> bytes:
        return self._encoder.encode(self._batch_type(ts=ts, events=events,
                                                     data_parallel_rank=data_parallel_rank))


def consumer_role_of(vllm_config: Any, class_name: str) -> str | None:
    """The kv_role when ``class_name`` is the engine's only connector and that role makes
    vLLM treat it as a KV consumer (see the package docstring), else None."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None or getattr(transfer, "kv_connector", None) != class_name:
        return None
    return str(transfer.kv_role) if getattr(transfer, "is_kv_consumer", False) else None


def register_connector_name(class_name: str, module_path: str) -> None:
    """Register a connector with vLLM's ``KVConnectorFactory`` by name (idempotent).
    A connector loaded by ``kv_connector_module_path`` alone is missing from that
    registry, yet ``MultiConnector.build_kv_connector_stats`` looks its children up there
    by class name in the API-server process."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and class_name in registry:
        return
    KVConnectorFactory.register_connector(class_name, module_path, class_name)


def none_hash_seed(hash_algo: str) -> str | None:
    """The seed of vLLM's NONE_HASH as the router must use it, or None when it is a
    per-process secret (non-cryptographic hash without PYTHONHASHSEED)."""
    from vllm.v1.core import kv_cache_utils

    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if hash_algo.startswith("xxhash"):
        return None
    return getattr(kv_cache_utils, "DEFAULT_NONE_HASH_SEED", "vllm-none-hash")


def find_engine_waker() -> Callable[[], None] | None:
    """A callable that wakes vLLM's idle EngineCore busy loop, or None.

    The busy loop blocks on ``input_queue.get()`` while it has no work; vLLM itself wakes
    it with a ``WAKEUP`` request. The connector is constructed inside
    ``EngineCore.__init__`` (through the Scheduler), so the engine object is on the call
    stack then: find the frame whose ``self`` owns an ``input_queue``. Any thread may call
    the waker (``queue.Queue.put_nowait`` is thread-safe). Once awake, the loop steps
    because the connector's ``has_pending_push_work()`` reports the waiting hint.
    """
    try:
        from vllm.v1.engine import EngineCoreRequestType
    except ImportError:
        return None
    wakeup = getattr(EngineCoreRequestType, "WAKEUP", None)
    if wakeup is None:
        return None
    engine = find_on_stack(lambda owner: _is_engine_core(owner)
                           and hasattr(getattr(owner, "input_queue", None), "put_nowait"))
    if engine is None:
        return None
    queue, message = engine.input_queue, (wakeup, None)
    return lambda: queue.put_nowait(message)


def _is_engine_core(owner: Any) -> bool:
    """Whether ``owner`` is one of vLLM's engine cores: by its class or a base's
    (``DPEngineCoreProc``, ``DPMoEEngineCoreActor``: one per data-parallel rank, each a
    subclass of ``EngineCore``; before, only a class named ``EngineCore*`` was found, and
    an idle data-parallel rank applied hints only at its next request)."""
    return any(cls.__name__ == "EngineCore" and cls.__module__.startswith("vllm.")
               for cls in type(owner).__mro__)


def find_on_stack(predicate: Callable[[Any], bool]) -> Any | None:
    """The nearest ``self`` up the caller's stack for which ``predicate`` holds, or None.
    For objects vLLM builds the plugin from inside but gives it no link to (the
    EngineCore, a MultiConnector)."""
    import inspect

    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if owner is not None and predicate(owner):
                return owner
            frame = frame.f_back
    finally:
        del frame
    return None
