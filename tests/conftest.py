import logging

import pytest
import torch

from kda_backend import plugins
from kda_backend.log import get_logger


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_plugins(monkeypatch):
    """Every test starts with a freshly built plugin manager, no broken providers, once-warnings, resolved plans or
    failed builds."""
    from kda_backend import dispatch, log, planning, serving

    monkeypatch.setattr(dispatch, "_broken", {})
    monkeypatch.setattr(serving, "_failed", {})
    monkeypatch.setattr(planning, "_resolved", {})
    monkeypatch.setattr(log, "_warned", set())
    plugins.reset_plugin_manager()
    yield
    plugins.reset_plugin_manager()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def messages(self, level=logging.WARNING):
        return [r.getMessage() for r in self.records if r.levelno >= level]


@pytest.fixture
def kda_log():
    """Records of the ``kda_backend`` logger (which does not propagate to the root logger), DEBUG included."""
    handler = _Records()
    logger = get_logger()
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)
