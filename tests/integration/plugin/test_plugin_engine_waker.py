"""The plugin finds vLLM's engine core up the stack it is built from, to wake the idle
busy loop when a hint comes: every kind of engine core, data-parallel ranks included.

The engine classes are vLLM's own; their ``__init__`` (a whole engine) is not run: the
waker needs only the object on the stack and its ``input_queue``."""

from __future__ import annotations

import queue

import pytest
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreProc

from kvhint.engine_plugin.vllm_adapter.engine import find_engine_waker

ENGINE_CLASSES = [EngineCoreProc, DPEngineCoreProc]
try:  # present where vLLM's Ray support is importable
    from vllm.v1.engine.core import DPMoEEngineCoreActor
    ENGINE_CLASSES.append(DPMoEEngineCoreActor)
except ImportError:
    pass


def _built_inside(engine_class: type) -> tuple[object, object]:
    """(the engine, the waker the plugin found) as when vLLM builds the connector from
    inside the engine's own constructor."""
    engine = object.__new__(engine_class)
    engine.input_queue = queue.Queue()

    def construct(self) -> object:  # noqa: ANN001 (a method: ``self`` on the stack)
        return find_engine_waker()

    return engine, construct(engine)


@pytest.mark.parametrize("engine_class", ENGINE_CLASSES, ids=lambda c: c.__name__)
def test_every_engine_core_is_found_and_woken(engine_class: type) -> None:
    """Before, only classes named ``EngineCore*`` were found: a data-parallel rank
    (``DPEngineCoreProc``) got no waker, and an idle rank applied hints only at its next
    request."""
    engine, waker = _built_inside(engine_class)
    assert waker is not None
    waker()
    assert engine.input_queue.get_nowait() == (EngineCoreRequestType.WAKEUP, None)


def test_an_object_that_is_not_an_engine_core_is_not_taken_for_one() -> None:
    class EngineCoreLookalike:  # an input_queue and the name, but not vLLM's engine
        pass

    _engine, waker = _built_inside(EngineCoreLookalike)
    assert waker is None
