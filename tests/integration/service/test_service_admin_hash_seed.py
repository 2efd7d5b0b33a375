"""A tenant admin does not read the workers' block-hash seed (security review of the
heartbeat's ``none_hash_seed``). On NATS it is inside the trust boundary, beside what
matters more (prompts' token ids, every tenant's ``cache_salt``, the block hashes
themselves: README.md's trust boundary). But the admin API relayed each worker's whole
heartbeat ``status`` to every tenant admin, the seed and the ``cache_namespace`` that
holds it in clear included: a worker's ``PYTHONHASHSEED`` where set, which is also its
Python processes' str-hash key and, with xxhash, what keeps its block hashes
unpredictable. Now null for a tenant admin; a fleet admin still reads both."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import msgspec
import nats
import pytest

from conftest import router_settings, running_router
from feed_helpers import status as heartbeat
from kvhint.schemas import Subjects, decode_status, encode_status

pytestmark = pytest.mark.usefixtures("throwaway_streams")

SEED = "operator-seed-9f3c"  # vLLM takes any PYTHONHASHSEED string (docs/router.md)
ROOT, A_ADMIN = ({"authorization": f"Bearer {key}"} for key in ("root", "aa"))


async def test_a_tenant_admin_reads_no_hash_seed(tmp_path: Path, nats_url: str,
                                                 subject_prefix: str) -> None:
    subjects = Subjects(subject_prefix)
    beat = msgspec.structs.replace(decode_status(heartbeat("w0", "e1", 0)),
                                   hash_algo="xxhash", none_hash_seed=SEED,
                                   cache_namespace=f"tiny|xxhash|{SEED}|bs32")
    settings = router_settings(tmp_path, [], nats_url=nats_url,
                               subject_prefix=subject_prefix, admin_keys=["root"],
                               tenants=[{"name": "a", "api_keys": ["ka"],
                                         "admin_keys": ["aa"]}])
    nc = await nats.connect(nats_url)
    try:
        async with running_router(settings) as router, httpx.AsyncClient() as client:
            runtime = router.runtime
            assert await runtime.link.wait_connected(10)

            # Beats until heard: the router's subscriptions may not be in place at the first.
            for _ in range(100):
                await nc.publish(subjects.status("w0"), encode_status(beat))
                await asyncio.sleep(0.1)
                worker = runtime.workers.get("w0")
                if worker is not None and worker.status is not None:
                    break
            assert runtime.workers.get("w0").status.none_hash_seed == SEED

            async def read(path: str, headers: dict[str, str]) -> httpx.Response:
                response = await client.get(f"{router.url}{path}", headers=headers)
                assert response.status_code == 200, (path, response.text)
                return response

            for path in ("/admin/workers", "/admin/workers/w0", "/admin/overview"):
                answer = await read(path, A_ADMIN)
                assert SEED not in answer.text, path
            status = (await read("/admin/workers/w0", A_ADMIN)).json()["status"]
            assert status["none_hash_seed"] is None and status["cache_namespace"] is None
            # Still there: what says whether the router can follow the worker.
            assert status["hash_algo"] == "xxhash" and status["block_size"] == 32
            fleet = (await read("/admin/workers/w0", ROOT)).json()["status"]
            assert fleet["none_hash_seed"] == SEED and SEED in fleet["cache_namespace"]
    finally:
        await nc.drain()
