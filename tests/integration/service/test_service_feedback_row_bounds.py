"""A worker's outcome feedback row (``learned_stats``, kind ``feedback:<worker>``) holding
values the router never writes, on SQLite and PostgreSQL: a pin ask scale that is NaN
(PostgreSQL's JSON gives it back as the string ``"NaN"``, SQLite as a bare NaN), infinite
(``1e999``), negative or over 1, in the worker's part or a tenant's; a rejection count that
is not a whole number >= 0. Before, each was restored: a NaN or negative scale stopped the
planner's Pins on the worker for good, one over 1 planned Pins past the room, a count of
another type failed every later outcome of its type (and the admin API showed them). Now such a row is refused at restore
(``WorkerFeedback.from_dict``), counted (``drops_total{what="learned_stats_unreadable"}``),
and the worker starts from fresh feedback; a row the router wrote is restored as it was.

Real router on each store; the rows are written as raw JSON text, as a hand edit or a
restore from elsewhere leaves them."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import sqlalchemy as sa

from conftest import StubWorker, router_settings, running_router, sample, scrape

NAN = "NaN"  # a bare NaN: SQLite's JSON text takes it, PostgreSQL's refuses it


def _feedback(worker: str, scale: object = 1.0, counts: object = None,
              tenant_scale: object = None) -> dict:
    """A feedback row as the router writes it (SplitFeedback.to_dict), with the worker's
    part's ``scale`` and ``counts``, and tenant "default"'s part of ``tenant_scale``."""

    def part(pin_ask_scale: object, rejections: object) -> dict:
        return {"worker_id": worker, "pin_ask_scale": pin_ask_scale, "disabled_actions": [],
                "disabled_reasons": {}, "rejections_in_row": rejections or {}}

    tenants = {} if tenant_scale is None else {"default": part(tenant_scale, None)}
    return {**part(scale, counts), "tenants": tenants}


# worker -> its feedback row as JSON text (placeholders for the values JSON cannot spell)
UNREADABLE = {
    "w_nan_text": _feedback("w_nan_text", "NaN"),
    "w_inf": _feedback("w_inf", "@1e999@"),
    "w_minus_inf": _feedback("w_minus_inf", "@-1e999@"),
    "w_negative": _feedback("w_negative", -0.5),
    "w_over": _feedback("w_over", 4.0),
    "w_tenant_inf": _feedback("w_tenant_inf", 1.0, tenant_scale="@1e999@"),
    "w_count_text": _feedback("w_count_text", counts={"kv.pin": "x"}),
    "w_count_frac": _feedback("w_count_frac", counts={"kv.pin": 1.5}),
    "w_count_negative": _feedback("w_count_negative", counts={"kv.pin": -1}),
}
KEPT = _feedback("w_ok", 0.5, counts={"kv.retain": 1}, tenant_scale=0.25)


def _text(row: dict) -> str:
    return json.dumps(row).replace('"@', "").replace('@"', "")


def _insert(database_url: str, rows: dict[str, str]) -> None:
    engine = sa.create_engine(database_url)
    json_of = "CAST(:d AS json)" if engine.dialect.name == "postgresql" else ":d"
    try:
        with engine.begin() as conn:
            for worker, data in rows.items():
                conn.execute(sa.text(
                    "INSERT INTO learned_stats (tenant, kind, data, updated_at) "
                    f"VALUES ('*', :k, {json_of}, 0)"), {"k": f"feedback:{worker}", "d": data})
    finally:
        engine.dispose()


async def test_a_feedback_row_the_router_never_writes_is_refused_and_counted(
        tmp_path: Path, database_url: str, stub_workers: list[StubWorker]) -> None:
    rows = {w: _text(row) for w, row in UNREADABLE.items()}
    if database_url.startswith("sqlite"):
        rows["w_nan_bare"] = _text(_feedback("w_nan_bare", f"@{NAN}@"))
    rows["w_ok"] = _text(KEPT)
    workers = [(w, stub_workers[0].url) for w in rows]
    settings = router_settings(tmp_path, workers, database_url=database_url)
    async with running_router(settings):
        pass  # the schema, and the workers' rows
    _insert(database_url, rows)
    async with running_router(settings) as router, httpx.AsyncClient(timeout=30) as client:
        feedback = router.runtime.hints.feedback
        refused = set(rows) - {"w_ok"}
        assert not refused & set(feedback)  # each starts afresh
        assert feedback["w_ok"].to_dict() == KEPT
        samples = await scrape(client, router.url)
        assert sample(samples, "kvhint_router_drops_total",
                      what="learned_stats_unreadable") == len(refused)
        listing = await client.get(f"{router.url}/admin/workers")
        assert listing.status_code == 200, listing.text
        shown = {w["worker_id"]: w["feedback"] for w in listing.json()["workers"]}
        assert shown["w_ok"]["pin_ask_scale"] == 0.5
        assert all(shown[w] is None for w in refused)
