"""snapshot_retry_max_s is a router setting: it reaches the ingestor the router runs with
(before, the bound on the doubling delay between failed or refused snapshot requests was
StreamConfig's 8 s, not a setting); out of its bounds it is refused, naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from conftest import router_settings, running_router


async def test_the_snapshot_retry_bound_is_a_router_setting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("0", "0.5", "601"):
        monkeypatch.setenv("KVHINT_ROUTER_SNAPSHOT_RETRY_MAX_S", bad)
        with pytest.raises(ValidationError) as refused:
            router_settings(tmp_path, [])
        assert "snapshot_retry_max_s" in str(refused.value)
    monkeypatch.setenv("KVHINT_ROUTER_SNAPSHOT_RETRY_MAX_S", "30")
    async with running_router(router_settings(tmp_path, [])) as router:
        assert router.runtime.ingestor.config.snapshot_retry_max_s == 30.0
    monkeypatch.delenv("KVHINT_ROUTER_SNAPSHOT_RETRY_MAX_S")
    assert router_settings(tmp_path, []).snapshot_retry_max_s == 8.0
