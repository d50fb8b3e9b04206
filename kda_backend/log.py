"""The package logger: records carry a ``[kda-backend]`` prefix and reach stderr even inside engines whose own
loggers do not propagate foreign records (vLLM)."""

from __future__ import annotations

import logging

from kda_backend import env

_LOGGER_NAME = "kda_backend"
_warned: set[str] = set()


def get_logger() -> logging.Logger:
    logger = logging.getLogger(_LOGGER_NAME)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[kda-backend] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(env.get("KDA_BACKEND_LOG_LEVEL").upper())
    return logger


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if key in _warned:
        return
    _warned.add(key)
    get_logger().warning(message)


def debug_once(key: str, message: str) -> None:
    """Log ``message`` at DEBUG the first time ``key`` is seen in this process."""
    if key in _warned:
        return
    _warned.add(key)
    get_logger().debug(message)
