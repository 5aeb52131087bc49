"""What a refusal tells the client, and what a client that retries does with it (the benchmarks' clients do).

The gateway answers a request it could serve later (its queue would make the request late, or no engine has
room) with 429 and ``Retry-After``, or 503 when no engine serves the model at all. The official ``openai``
client retries both ``max_retries`` times (2 by default), after ``Retry-After`` when the header gives one of
at most 60 s, so a refused request comes back, and a benchmark that does not send it back undercounts the
load a refusing policy faces.
"""

from __future__ import annotations

#: Seconds the gateway asks a refused client to wait (``Retry-After`` on every 429): about the time a queue
#: takes to move by a request at the loads where refusals start.
RETRY_AFTER_S = 1
#: Statuses a client may retry: the service refused the request for now, it did not fail it.
REFUSAL_STATUSES = (429, 503)
#: Retries of the official ``openai`` client (``max_retries``): a request refused three times is given up.
CLIENT_MAX_RETRIES = 2
#: The header in which the ``openai`` clients (and the other Stainless-built SDKs) send how many times they sent
#: the request before: 0 on a first send.
RETRY_COUNT_HEADER = "x-stainless-retry-count"


def sent_before(header: str | None) -> int:
    """The client's earlier sends of a request from its :data:`RETRY_COUNT_HEADER`: 0 without one or with a
    value that is not a count (an informational header: a malformed one is no reason to refuse the request)."""
    if header is None:
        return 0
    value = header.strip()
    return min(int(value), 1_000_000) if value.isascii() and value.isdigit() else 0


def retry_after_header() -> dict[str, str]:
    """The header a 429 carries."""
    return {"retry-after": str(RETRY_AFTER_S)}


def retry_after_s(status: int) -> float | None:
    """The Retry-After the gateway sends with a refusal of this status (a 503 carries none)."""
    return float(RETRY_AFTER_S) if status == 429 else None


def client_wait_s(retry_after: float | None, attempt: int) -> float:
    """How long the ``openai`` client waits before sending a refused request again, after its ``attempt``-th
    send: the server's Retry-After when it gives one of at most 60 s, else its backoff (0.5 s doubling, at
    most 8 s; the client's jitter left out, so runs repeat)."""
    if retry_after is not None and 0 < retry_after <= 60:
        return retry_after
    return min(0.5 * 2 ** (attempt - 1), 8.0)
