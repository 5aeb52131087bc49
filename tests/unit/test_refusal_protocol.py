"""What a refusal tells a client and what a retrying client tells the gateway (shared/protocol/refusal.py)."""

from __future__ import annotations

from shared.protocol.refusal import client_wait_s, retry_after_s, sent_before


def test_the_openai_clients_retry_count_is_read_and_a_malformed_one_is_a_first_send() -> None:
    assert sent_before(None) == 0 and sent_before("0") == 0
    assert sent_before("2") == 2 and sent_before(" 1 ") == 1
    for bad in ("", "-1", "1.5", "two", "²", "0x10"):
        assert sent_before(bad) == 0, bad
    assert sent_before("9" * 40) == 1_000_000  # bounded: it only orders a queue


def test_a_client_waits_the_retry_after_of_a_429_and_backs_off_without_one() -> None:
    assert retry_after_s(429) == 1.0 and retry_after_s(503) is None
    assert client_wait_s(1.0, 1) == 1.0
    assert [client_wait_s(None, a) for a in (1, 2, 3, 6)] == [0.5, 1.0, 2.0, 8.0]
    assert client_wait_s(120.0, 1) == 0.5  # past the client's 60 s cap: its own backoff
