"""Every value the router can give ``kvhint_router_drops_total{what}``, read from its code.

A drop is a call named ``drop``, ``_drop``, ``on_drop`` or ``_on_drop`` (RouterMetrics.drop,
and the callbacks the store writer, the session registry and the trace recorder get
bound to it) whose first argument is the ``what``. Literals are read as they are; the
computed ones each have a resolver below, and a call site none resolves raises, so a new
computed drop has to be resolved here (and classified by the deploy tests) before they
pass.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
ROUTER = REPO / "router"
_DROP_CALLS = ("drop", "_drop", "on_drop", "_on_drop")
# policy/holdings.py's _drop(held) takes a holding out of its tables: no metric.
_NOT_METRICS = {ROUTER / "policy" / "holdings.py"}


class UnresolvedDrop(AssertionError):
    """A drop whose ``what`` is computed in a way no resolver here reads."""


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _function(path: Path, name: str) -> ast.FunctionDef:
    (node,) = [n for n in ast.walk(_tree(path))
               if isinstance(n, ast.FunctionDef) and n.name == name]
    return node


def _strings(nodes: list[ast.AST]) -> set[str]:
    """The non-empty string literals of ``nodes`` and of the tuples among them."""
    out = set()
    for node in nodes:
        for part in node.elts if isinstance(node, ast.Tuple) else [node]:
            if isinstance(part, ast.Constant) and isinstance(part.value, str) and part.value:
                out.add(part.value)
    return out


def _returned(path: Path, function: str) -> set[str]:
    return _strings([n.value for n in ast.walk(_function(path, function))
                     if isinstance(n, ast.Return) and n.value is not None])


def _assigned(path: Path, function: str) -> set[str]:
    return _strings([n.value for n in ast.walk(_function(path, function))
                     if isinstance(n, ast.Assign)])


def _call_literals(path: Path, method: str, position: int) -> set[str]:
    return _strings([n.args[position] for n in ast.walk(_tree(path))
                     if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                     and n.func.attr == method])


def _hashing_errors() -> set[str]:
    from kvhint.router.hashing.errors import HashingError

    found, todo = set(), [HashingError]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo += cls.__subclasses__()
    return found


_SERVICE = ROUTER / "service"
# f"<opening>{...}": the values after the opening.
_F_STRINGS: dict[str, Callable[[], set[str]]] = {
    # routing_service: f"prompt_hashing:{type(exc).__name__}" for a HashingError.
    "prompt_hashing:": _hashing_errors,
    # forwarding._still_its_address(worker, what): f"worker_left_address:{what}".
    "worker_left_address:": lambda: _call_literals(
        _SERVICE / "forwarding.py", "_still_its_address", 1),
}
# (file, variable): the values a drop named by that variable takes.
_VARIABLES: dict[tuple[str, str], Callable[[], set[str]]] = {
    # lost := observation.usage_lost(status)
    ("service/flight_accounting.py", "lost"): lambda: _returned(
        _SERVICE / "response_scan.py", "usage_lost"),
    # TraceRecorder.finished(ticket, request, reason): flight_accounting's _traced gives the
    # reason, and finished() replaces it with its own for a request it cannot record.
    ("service/trace_recorder.py", "reason"): lambda: _returned(
        _SERVICE / "flight_accounting.py", "_traced") | _assigned(
        _SERVICE / "trace_recorder.py", "finished"),
    # ClusterFeed._decoded(msg, decode, what, drop): each caller names its drop.
    ("service/cluster_feed.py", "drop"): lambda: _call_literals(
        _SERVICE / "cluster_feed.py", "_decoded", 3),
}


def _drop_arguments() -> Iterator[tuple[Path, ast.expr]]:
    for path in sorted(ROUTER.rglob("*.py")):
        if path in _NOT_METRICS:
            continue
        for node in ast.walk(_tree(path)):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in _DROP_CALLS:
                yield path, node.args[0]


def emitted_drop_reasons() -> set[str]:
    """Every ``what`` the router's code can count a drop under."""
    reasons: set[str] = set()
    for path, arg in _drop_arguments():
        where = f"{path.relative_to(ROUTER)}:{arg.lineno}"
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            reasons.add(arg.value)
        elif (isinstance(arg, ast.JoinedStr) and isinstance(arg.values[0], ast.Constant)
              and arg.values[0].value in _F_STRINGS):
            opening = arg.values[0].value
            reasons |= {opening + rest for rest in _F_STRINGS[opening]()}
        elif isinstance(arg, ast.Name) and (key := (
                str(path.relative_to(ROUTER)), arg.id)) in _VARIABLES:
            reasons |= _VARIABLES[key]()
        else:
            raise UnresolvedDrop(f"{where}: a drop named by {ast.unparse(arg)}: say in "
                                 f"{Path(__file__).name} which values it takes")
    return reasons
