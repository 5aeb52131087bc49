"""free_port never hands out one port twice, though the OS offers a just-released port again."""

from __future__ import annotations

import socket

from shared.devservers import free_port


def test_free_ports_handed_out_are_distinct_and_bindable() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[-1]))  # still free: nothing here bound it
