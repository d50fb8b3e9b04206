"""Helpers shared by the engine adapter tests."""

import socket


def free_port() -> int:
    """A free TCP port on loopback for a one-rank gloo group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
