"""HTTP to the workers: one pooled aiohttp session for the router's lifetime.

aiohttp rather than httpx because the proxy's own overhead is a benchmark target (it
adds less per request here). :meth:`UpstreamPool.open` returns once the worker has sent
its status line and headers; everything that fails before that point is an
:class:`UpstreamUnavailable`, the only failure the router retries on another worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import aiohttp

# Statuses that mean "this worker cannot take the request now" (a proxy or the server
# itself refusing): retried on the next-best worker like a refused connection.
RETRYABLE_STATUSES = frozenset({502, 503, 504})

# Never copied from a worker's response to the client.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding",
    "server", "date", "proxy-authenticate", "trailer", "upgrade",
})


class UpstreamUnavailable(Exception):
    """The worker could not be reached or refused before the response started."""

    def __init__(self, worker_id: str, reason: str, status: int | None = None,
                 body: bytes = b"") -> None:
        super().__init__(f"worker {worker_id}: {reason}")
        self.worker_id = worker_id
        self.reason = reason
        self.status = status
        self.body = body


class UpstreamBroken(Exception):
    """The worker failed after the response started (the client may have bytes)."""


@dataclass(slots=True)
class UpstreamResponse:
    worker_id: str
    status: int
    headers: dict[str, str]
    _response: aiohttp.ClientResponse

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise UpstreamBroken(f"worker {self.worker_id}: {type(exc).__name__}: {exc}") from exc
        finally:
            self._response.release()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise UpstreamBroken(f"worker {self.worker_id}: {type(exc).__name__}: {exc}") from exc
        finally:
            self._response.close()

    def close(self) -> None:
        self._response.close()


class UpstreamPool:
    def __init__(self, connect_timeout_s: float, request_timeout_s: float,
                 worker_api_key: str | None = None, *, keepalive_s: float) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._keepalive_s = keepalive_s
        self._base_headers = {"Content-Type": "application/json"}
        if worker_api_key:
            self._base_headers["Authorization"] = f"Bearer {worker_api_key}"
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self._keepalive_s,
                                         ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=self._request_timeout_s,
                                        sock_connect=self._connect_timeout_s)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout,
                                              auto_decompress=False, skip_auto_headers=(
                                                  "User-Agent", "Accept-Encoding"))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("UpstreamPool used before start()")
        return self._session

    async def open(self, worker_id: str, url: str, body: bytes,
                   extra_headers: Mapping[str, str] | None = None) -> UpstreamResponse:
        headers = dict(self._base_headers)
        if extra_headers:
            headers.update(extra_headers)
        try:
            response = await self.session.post(url, data=body, headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise UpstreamUnavailable(worker_id, f"{type(exc).__name__}: {exc}") from exc
        if response.status in RETRYABLE_STATUSES:
            try:
                error_body = await response.read()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                error_body = b""
            finally:
                response.release()
            raise UpstreamUnavailable(worker_id, f"HTTP {response.status}", response.status,
                                      error_body)
        return UpstreamResponse(worker_id, response.status, _copy_headers(response), response)

    async def get_json(self, url: str, timeout_s: float) -> object:
        """Small GETs (health probes, /v1/models); raises on any failure."""
        async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                    headers=self._base_headers) as response:
            response.raise_for_status()
            return await response.json(content_type=None)

    async def get_ok(self, url: str, timeout_s: float) -> bool:
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                        headers=self._base_headers) as response:
                return response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False


def _copy_headers(response: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() not in _HOP_BY_HOP}
