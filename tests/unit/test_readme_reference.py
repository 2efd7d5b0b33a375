"""The reference tables are held to the code (REFERENCE.md: the router's settings and
metrics; docs/engine_plugin.md: the plugin's extra config and metrics paragraph): every router setting
(nested ones included) and every key of the plugin's extra config has a row with its environment
variable, default and bounds as the settings models declare them, and every metric the
router exports has a row naming its labels and, for the labels the code bounds, exactly
their values; the plugin's metrics paragraph names every series it exports. A setting,
metric or label value added, renamed or changed without its document fails here.

The tables are read as Markdown rows (``| cell | cell |``); defaults are YAML literals
(what an operator writes in ``router.yaml``), bounds ``op value`` items, both in
backticks, so the prose around them may change freely.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types
import pytest
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kvhint.engine_plugin import metrics as plugin_metrics
from kvhint.engine_plugin.config import PluginConfig
from kvhint.router.service import metric_labels
from kvhint.router.service.hint_records import API_SOURCE, EXPIRED, FAILED, PLANNER_SOURCE
from kvhint.router.service.inbound import Endpoint
from kvhint.router.service.settings import ENV_PREFIX, RouterSettings
from kvhint.schemas.outcomes import OutcomeStatus
from kvhint.schemas.releases import ReleaseReason
from tests.unit.service.router_families import router_families

_ROOT = Path(__file__).resolve().parents[2]
# The plugin's part of the README (its extra config table, its metrics paragraph).
PLUGIN_DOC = (_ROOT / "docs" / "engine_plugin.md").read_text()
REFERENCE = (_ROOT / "REFERENCE.md").read_text()
_TICKED = re.compile(r"`([^`]*)`")
_BOUND = re.compile(r"^(>=|>|<=|<|length >=) (\S+)$")
_BOUND_TYPES = ((annotated_types.Ge, ">=", "ge"), (annotated_types.Gt, ">", "gt"),
                (annotated_types.Le, "<=", "le"), (annotated_types.Lt, "<", "lt"),
                (annotated_types.MinLen, "length >=", "min_length"))


def _table(heading_or_lead: str, document: str = PLUGIN_DOC) -> dict[str, list[str]]:
    """The first Markdown table after ``heading_or_lead`` in ``document``: its first cell
    (the backticked name) -> its other cells."""
    start = document.index(heading_or_lead)
    lines = document[start:].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows: dict[str, list[str]] = {}
    for line in lines[first + 2:]:  # past the header and its |---| line
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        (name,) = _TICKED.findall(cells[0])
        assert name not in rows, f"README table after {heading_or_lead!r}: {name} twice"
        rows[name] = cells[1:]
    assert rows, f"no table after {heading_or_lead!r}"
    return rows


# --- settings ----------------------------------------------------------------------------

def _unwrap(annotation: Any) -> Any:
    """``Annotated[X, ...]`` and ``X | None`` -> ``X``."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation


def _model(annotation: Any) -> type[BaseModel] | None:
    annotation = _unwrap(annotation)
    return annotation if isinstance(annotation, type) and issubclass(
        annotation, BaseModel) else None


def _setting_paths(model: type[BaseModel], prefix: str = "",
                   env: str | None = None) -> dict[str, tuple[FieldInfo, str | None]]:
    """Every setting of ``model`` as the README names it -> (its field, its environment
    variable or None). A nested model's fields are ``parent.field`` (no row of their
    own parent: its variable is ``PARENT__FIELD``); a list of models is a row, and its
    entries' fields ``parent[].field``; a dict of models, ``parent.<model>.field``."""
    paths: dict[str, tuple[FieldInfo, str | None]] = {}
    for name, field in model.model_fields.items():
        path, variable = prefix + name, (env + name.upper() if env else None)
        annotation = _unwrap(field.annotation)
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if (nested := _model(annotation)) is not None:
            paths |= _setting_paths(nested, path + ".", variable and variable + "__")
        elif origin is list and (entry := _model(args[0])) is not None:
            paths[path] = (field, variable)
            paths |= _setting_paths(entry, path + "[].")
        elif origin is dict and (entry := _model(args[1])) is not None:
            paths[path] = (field, variable)
            paths |= _setting_paths(entry, path + ".<model>.")
        else:
            paths[path] = (field, variable)
    return paths


def _bounds(field: FieldInfo) -> set[tuple[str, float]]:
    return {(op, float(getattr(m, attr))) for m in field.metadata
            for kind, op, attr in _BOUND_TYPES if isinstance(m, kind)}


def _documented_bounds(cell: str) -> set[tuple[str, float]]:
    out = set()
    for item in _TICKED.findall(cell):
        match = _BOUND.match(item)
        assert match, f"bounds cell item {item!r} is not 'op value'"
        out.add((match[1], float(match[2])))
    return out


def _default_problem(field: FieldInfo, cell: str) -> str | None:
    if field.is_required():
        return None if cell == "required" else f"required, README says {cell!r}"
    ticked = _TICKED.findall(cell)
    if not ticked:
        return f"no backticked default in {cell!r}"
    default = field.get_default(call_default_factory=True)
    documented = yaml.safe_load(ticked[0])
    return None if documented == default else f"default {default!r}, README says {ticked[0]}"


def _settings_problems(paths: dict[str, tuple[FieldInfo, str | None]],
                       rows: dict[str, list[str]], with_env: bool) -> list[str]:
    problems = [f"{p}: no README row" for p in paths if p not in rows]
    problems += [f"{p}: README row for no such setting" for p in rows if p not in paths]
    for path, (field, variable) in paths.items():
        if path not in rows:
            continue
        cells = rows[path]
        if with_env:
            expected = f"`{variable}`" if variable else "—"
            if cells[0] != expected:
                problems.append(f"{path}: environment {expected}, README says {cells[0]}")
            cells = cells[1:]
        default_cell, bounds_cell = cells[0], cells[1]
        if problem := _default_problem(field, default_cell):
            problems.append(f"{path}: {problem}")
        if _documented_bounds(bounds_cell) != _bounds(field):
            problems.append(f"{path}: bounds {sorted(_bounds(field))}, README says "
                            f"{bounds_cell}")
    return problems


def test_every_router_setting_is_in_the_readme_with_its_variable_default_and_bounds() -> None:
    paths = _setting_paths(RouterSettings, env=ENV_PREFIX)
    # The walk reached the nested models (a change to it would check nothing).
    assert {"routing.max_n", "hints.tick_s", "tenants[].budget.max_worker_share",
            "workers[].url", "model_prompts.<model>.chat_template"} <= set(paths)
    assert paths["routing.max_n"][1] == "KVHINT_ROUTER_ROUTING__MAX_N"
    problems = _settings_problems(paths, _table("## Router settings", REFERENCE), with_env=True)
    assert not problems, "REFERENCE.md's router settings table:\n" + "\n".join(problems)


def test_every_plugin_config_key_is_in_the_readme_with_its_default_and_bounds() -> None:
    problems = _settings_problems(_setting_paths(PluginConfig),
                                  _table("Each key's default and bounds"), with_env=False)
    assert not problems, "README's plugin config table:\n" + "\n".join(problems)


# --- metrics -----------------------------------------------------------------------------

def _router_families() -> dict[str, tuple[str, frozenset[str]]]:
    """Each series name an operator queries (counters with ``_total``, histograms by
    their base name) -> (type, label names), from a real RouterMetrics."""
    _, families = router_families()
    out = {}
    for family, labels in families:
        name = family.name + ("_total" if family.type == "counter" else "")
        out[name] = (family.type, labels)
    return out


def _bounded_labels() -> dict[str, dict[str, set[str]]]:
    """The label values the code fixes, per metric: the README lists exactly these."""
    m = metric_labels
    sources = {PLANNER_SOURCE, API_SOURCE}
    return {
        "kvhint_router_requests_total": {"endpoint": {e.value for e in Endpoint}},
        "kvhint_router_hints_sent_total": {"source": sources},
        "kvhint_router_hints_total": {
            "source": sources,
            "outcome": {s.value for s in OutcomeStatus if s.is_terminal} | {EXPIRED, FAILED}},
        "kvhint_router_hold_released_blocks_total": {"reason": {r.value for r in ReleaseReason}},
        "kvhint_router_cached_tokens_actual_total": {"predicted": {"true", "false"}},
        "kvhint_router_nats_errors_total": {"kind": set(m.NATS_ERROR_KINDS)},
        "kvhint_router_streams_remade_total": {"stream": set(m.STREAM_KINDS)},
        "kvhint_router_hint_api_rejections_total": {"reason": set(m.HINT_API_REJECTIONS)},
        "kvhint_router_session_end_rejections_total": {
            "reason": set(m.SESSION_END_REJECTIONS)},
        "kvhint_router_session_end_skips_total": {"reason": set(m.SESSION_END_SKIPS)},
        "kvhint_router_admin_rejections_total": {"reason": set(m.ADMIN_REJECTIONS)},
        "kvhint_router_route_refusals_total": {"reason": set(m.ROUTE_REFUSALS)},
        "kvhint_router_cross_site_refusals_total": {
            "endpoint": set(m.CROSS_SITE_ENDPOINTS), "reason": set(m.CROSS_SITE_REASONS)},
        "kvhint_router_cors_refusals_total": {"reason": set(m.CORS_REFUSAL_REASONS)},
        "kvhint_router_client_timeouts_total": {"phase": set(m.CLIENT_TIMEOUT_PHASES)},
        "kvhint_router_gateway_rejections_total": {"reason": set(m.GATEWAY_REJECTIONS)},
        "kvhint_router_health_probes_total": {"outcome": set(m.HEALTH_PROBE_OUTCOMES)},
        "kvhint_router_response_id_misses_total": {"reason": set(m.RESPONSE_ID_MISSES)},
        "kvhint_router_response_id_requests_total": {"op": set(m.RESPONSE_ID_OPS)},
        "kvhint_router_response_session_reads_total": {
            "outcome": set(m.RESPONSE_SESSION_READS)},
        "kvhint_router_session_reads_total": {"outcome": set(m.SESSION_READS)},
        "kvhint_router_session_refreshes_total": {"outcome": set(m.SESSION_REFRESHES)},
        "kvhint_router_session_save_conflicts_total": {
            "outcome": set(m.SESSION_SAVE_CONFLICTS)},
        "kvhint_router_responses_router_ends_total": {
            "reason": set(m.RESPONSES_ROUTER_END_REASONS)},
        "kvhint_router_responses_read_failed_total": {
            "reason": set(m.RESPONSES_READ_FAILED_REASONS)},
        "kvhint_router_responses_cancel_notices_total": {
            "outcome": set(m.RESPONSES_CANCEL_NOTICE_OUTCOMES)},
    }


def _documented_labels(cell: str) -> dict[str, set[str] | None]:
    """``"`a` (`x`, `y`: why), `b`"`` -> ``{"a": {"x", "y"}, "b": None}``."""
    labels: dict[str, set[str] | None] = {}
    for match in re.finditer(r"`([a-z_]+)`( \(([^)]*)\))?", cell):
        labels.setdefault(match[1], set(_TICKED.findall(match[3])) if match[3] else None)
    return labels


def test_every_router_metric_is_in_the_readme_with_its_labels_and_their_values() -> None:
    families = _router_families()
    rows = _table("## Router metrics", REFERENCE)
    bounded = _bounded_labels()
    problems = [f"{n}: no README row" for n in families if n not in rows]
    problems += [f"{n}: README row for no exported metric" for n in rows if n not in families]
    for name, (kind, labels) in families.items():
        if name not in rows:
            continue
        documented_kind, cell = rows[name][0], rows[name][1]
        if documented_kind != kind:
            problems.append(f"{name}: a {kind}, README says {documented_kind}")
        documented = _documented_labels(cell) if cell != "—" else {}
        if set(documented) != labels:
            problems.append(f"{name}: labels {sorted(labels)}, README says "
                            f"{sorted(documented)}")
        for label, values in bounded.get(name, {}).items():
            if documented.get(label) != values:
                problems.append(f"{name}{{{label}}}: values {sorted(values)}, README says "
                                f"{sorted(documented.get(label) or ())}")
    assert not problems, "REFERENCE.md's router metrics table:\n" + "\n".join(problems)


def test_every_bounded_label_set_of_the_router_is_checked_against_the_readme() -> None:
    """A new bounded set in metric_labels.py (a tuple of label values) must be added to
    _bounded_labels above, so its values reach the README too."""
    checked = {frozenset(v) for labels in _bounded_labels().values() for v in labels.values()}
    sets = {name: frozenset(value) for name, value in vars(metric_labels).items()
            if name.isupper() and isinstance(value, tuple)
            and all(isinstance(v, str) for v in value)}
    assert sets, "metric_labels.py declares no bounded label set: the scan is wrong"
    unchecked = sorted(name for name, values in sets.items() if values not in checked)
    assert not unchecked, f"bounded label sets not held to the README: {unchecked}"


def test_the_plugin_metrics_paragraph_names_every_series_and_label_value() -> None:
    start = PLUGIN_DOC.index("Metrics appear on vLLM's own `/metrics`")
    paragraph = PLUGIN_DOC[start:PLUGIN_DOC.index("\n\n", start)]
    problems = []
    for series in sorted(plugin_metrics.exposed_names()):
        base = re.sub(r"_(bucket|sum|count)$", "", series)
        if not re.search(rf"`{re.escape(base)}[`{{]", paragraph):
            problems.append(f"{series}: not named")
    for key, (label, values, _) in plugin_metrics.LABELLED_COUNTERS.items():
        name = f"{plugin_metrics.PREFIX}{key}_total"
        match = re.search(rf"`{re.escape(name)}\{{{label}\}}` \(([^)]*)\)", paragraph)
        documented = set(_TICKED.findall(match[1])) if match else set()
        if documented != set(values):
            problems.append(f"{name}{{{label}}}: values {sorted(values)}, README says "
                            f"{sorted(documented)}")
    assert not problems, "README's plugin metrics:\n" + "\n".join(problems)


@pytest.mark.parametrize("cell, labels", [
    ("`worker`, `reason` (`a`: 1, `b`)", {"worker": None, "reason": {"a", "b"}}),
    ("`endpoint` (`chat`)", {"endpoint": {"chat"}}),
])
def test_the_label_cell_reader(cell: str, labels: dict) -> None:
    assert _documented_labels(cell) == labels
