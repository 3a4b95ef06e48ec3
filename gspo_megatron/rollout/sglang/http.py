"""A small JSON-over-HTTP client for SGLang servers, standard library only.

Errors are classified because they call for different actions:
- ``ServerUnreachable``: no HTTP answer (refused, reset, timed out). The server may be dead: restart it
  if we own it, else try another one; retried.
- ``ServerBusy``: HTTP 5xx (SGLang answers 503 while starting or when unhealthy); retried.
- ``ServerRejected``: HTTP 4xx. SGLang answers 400 for a malformed request or a failed weight update
  ({"success": false, "message": ...}); retrying cannot help, so it is raised at once with the message.
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import time
import urllib.parse
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class SGLangHTTPError(RuntimeError):
    """Base of the errors below; the message names the URL and path."""


class ServerUnreachable(SGLangHTTPError):
    pass


class ServerBusy(SGLangHTTPError):
    pass


class ServerRejected(SGLangHTTPError):
    """``body``: the answer, decoded (JSON, else text), so a caller can tell one refusal from another."""

    def __init__(self, message: str, status: int, body: Any = None):
        super().__init__(message)
        self.status = status
        self.body = body


class RetriesExhausted(SGLangHTTPError):
    pass


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff: attempt k (k = 1..max_retries) waits min(backoff_max_s, backoff_s * 2**(k-1)),
    and no attempt starts after deadline_s from the first one."""

    max_retries: int
    backoff_s: float
    backoff_max_s: float
    deadline_s: float

    def delay_s(self, retry: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** (retry - 1))


def _split(url: str) -> tuple[str, str, int, str]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, parts.hostname, port, parts.path.rstrip("/")


def _excerpt(body: bytes, limit: int = 600) -> str:
    text = body.decode("utf-8", errors="replace")
    return text if len(text) <= limit else text[:limit] + "..."


def request(url: str, method: str, path: str, payload: Any = None, *, timeout_s: float) -> Any:
    """One HTTP request; returns the decoded JSON body (or the text, for SGLang's plain-text answers such
    as /flush_cache's "Cache flushed."), or None for an empty body."""
    scheme, host, port, base = _split(url)
    conn_cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(host, port, timeout=timeout_s)
    body = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"} if body is not None else {}
    where = f"{method} {url}{path}"
    try:
        conn.request(method, base + path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        status = response.status
        content_type = response.getheader("Content-Type", "")
    except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out, cut mid-answer
        raise ServerUnreachable(f"{where}: no answer ({type(err).__name__}: {err})") from err
    finally:
        conn.close()
    if 400 <= status < 500:
        raise ServerRejected(f"{where}: HTTP {status}: {_excerpt(data)}", status, _error_body(data))
    if status >= 500:
        raise ServerBusy(f"{where}: HTTP {status}: {_excerpt(data)}")
    return _decoded(data, content_type)


def _error_body(data: bytes) -> Any:
    """A refusal's body: SGLang's JSON (``{"error": {"message": ...}}``), else its text. A body that is not
    JSON stays text: the ServerRejected raised with it says what came back either way."""
    text = data.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _decoded(data: bytes, content_type: str) -> Any:
    if not data:
        return None
    if "json" in content_type:
        return json.loads(data)
    return data.decode("utf-8", errors="replace")


def call_with_retry(fn: Callable[[], T], policy: RetryPolicy, *, what: str,
                    on_unreachable: Callable[[ServerUnreachable], None] | None = None,
                    sleep: Callable[[float], None] = time.sleep,
                    clock: Callable[[], float] = time.monotonic) -> T:
    """Run ``fn`` until it succeeds, retrying ServerUnreachable / ServerBusy with backoff.

    ``on_unreachable`` runs before the next attempt (restart a dead server we own). ServerRejected and any
    other exception propagate at once. Gives up with RetriesExhausted after max_retries retries or when
    the next attempt would start past the deadline.
    """
    start = clock()
    retry = 0
    while True:
        try:
            return fn()
        except (ServerUnreachable, ServerBusy) as err:
            retry += 1
            delay = policy.delay_s(retry)
            if retry > policy.max_retries or clock() + delay - start > policy.deadline_s:
                raise RetriesExhausted(f"{what}: gave up after {retry} attempt(s) in {clock() - start:.1f} s: {err}") from err
            if isinstance(err, ServerUnreachable) and on_unreachable is not None:
                on_unreachable(err)
            sleep(delay)


__all__ = ["RetriesExhausted", "RetryPolicy", "SGLangHTTPError", "ServerBusy", "ServerRejected",
           "ServerUnreachable", "call_with_retry", "request"]
