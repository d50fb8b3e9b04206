"""Helpers shared by the engine adapter tests."""

import socket

from kda_backend import hookimpl


def free_port() -> int:
    """A free TCP port on loopback for a one-rank gloo group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CountingShare:
    """Stands for an engine's TP broadcast of the plan (the ``kda_share_plan`` hook): counts every call. A share
    from a forward would be a collective waiting for a rank that skips that forward; tests assert the count stays
    at the ranks' loads."""

    def __init__(self) -> None:
        self.calls = 0

    @hookimpl(tryfirst=True)
    def kda_share_plan(self, plan):
        self.calls += 1
        return plan
