"""Every HTTP call a run makes to a server it depends on (reward servers, judges, served models): retries with
backoff, a wall-clock bound per attempt and a deadline for the whole call.

    reply = post(url, what="judge", json=body, timeout=60, max_retries=3, backoff=0.5, deadline=300)
    reply = request("GET", url, what="vLLM server", params={...}, timeout=10, max_retries=0)

An attempt ends after `timeout` seconds of wall clock whatever the server does: `requests`' own timeout bounds each
socket read only, so a server that trickles a byte now and then would hold a call (and a run) for ever; here the
attempt runs in a worker thread that is given up on at its bound, and the reply is read in chunks against it.
Connection errors, 429 and 5xx replies, and timeouts (unless `retry_timeouts=False`: a busy server would be sent
the same work again) are retried after backoff * 2^(attempt - 1) seconds, until `max_retries` retries or the
`deadline` (seconds for all attempts and waits together; None: no bound beyond the attempts') is spent. Any other
reply comes back to the caller, who reads its status. URLs in errors and logs have their credentials redacted.
"""

from __future__ import annotations

import json as jsonlib
import logging
import threading
import time
from typing import NamedTuple, Optional

import requests

from utils.core.secrets import redact_url

logger = logging.getLogger(__name__)
RETRY_STATUS = (429,)  # and every 5xx


class HTTPFailure(RuntimeError):
    """No usable reply: every attempt failed, or the deadline passed."""


class HTTPTimeout(HTTPFailure, TimeoutError):
    """The server sent no whole reply in time."""


class Reply(NamedTuple):
    status: int
    content: bytes
    headers: Optional[dict] = None

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self):
        return jsonlib.loads(self.content)


class _Slow(Exception):
    pass


def _attempt(method, url, bound, options, out):
    """One request whose reply is read in chunks against `bound` (monotonic time); the result or error into `out`."""
    try:
        with requests.request(method, url, timeout=max(bound - time.monotonic(), 0.001), stream=True,
                              **options) as response:
            chunks = []
            for chunk in response.iter_content(1 << 16):
                chunks.append(chunk)
                if time.monotonic() > bound:
                    raise _Slow()
            out.append(Reply(response.status_code, b"".join(chunks), dict(response.headers)))
    except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
        out.append(error)


def post(url, **kwargs) -> Reply:
    """POST to `url`: `request("POST", url, ...)`."""
    return request("POST", url, **kwargs)


def request(method, url, *, what="server", timeout=60.0, max_retries=3, backoff=0.5, deadline=None,
            retry_timeouts=True, failure=HTTPFailure, timeout_error=HTTPTimeout, quiet=False, **options) -> Reply:
    """`method` (GET, POST, ...) `url` with `options` (requests' keywords: json, data, params, headers); see the
    module docstring. `failure` and `timeout_error` are the exception classes raised (a caller's own, e.g.
    JudgeError). `quiet`: no warning per failed attempt (a caller polling a server that is still starting)."""
    shown = redact_url(url)
    start = time.monotonic()
    end = start + deadline if deadline is not None else float("inf")
    attempts, last = 0, None
    for attempt in range(max_retries + 1):
        if attempt:
            time.sleep(max(min(backoff * 2 ** (attempt - 1), end - time.monotonic()), 0.0))
        if time.monotonic() >= end:
            break
        attempts += 1
        bound = min(time.monotonic() + timeout, end)
        out = []
        worker = threading.Thread(target=_attempt, args=(method, url, bound, options, out), daemon=True,
                                  name="http-attempt")
        worker.start()
        worker.join(max(bound - time.monotonic(), 0.0) + 0.05)
        result = out[0] if out else _Slow()  # a worker still waiting is given up on (it ends on its socket timeout)
        if isinstance(result, Reply):
            if result.status in RETRY_STATUS or result.status >= 500:
                last = f"HTTP {result.status}: {result.text[-300:]}"
            else:
                return result
        elif isinstance(result, (_Slow, requests.exceptions.Timeout)) and not isinstance(
                result, requests.exceptions.ConnectTimeout):
            last = f"no whole reply within timeout={timeout}s"
            if not retry_timeouts:
                raise timeout_error(f"{what} {shown} sent no reply within timeout={timeout}s")
        elif isinstance(result, requests.exceptions.RequestException):
            last = f"connection error: {redact_url(str(result))}"
        else:
            raise result
        if not quiet:
            logger.warning("%s %s: %s (attempt %d/%d)", what, shown, last, attempt + 1, max_retries + 1)
    if time.monotonic() >= end:
        raise timeout_error(f"{what} {shown}: no usable reply within the deadline of {deadline}s ({attempts} "
                            f"attempts, timeout={timeout}s each); last error: {last}")
    raise failure(f"{what} {shown} failed after {attempts} attempts (timeout={timeout}s); last error: {last}")
