"""The package logger: records carry a ``[kda-backend]`` prefix and reach stderr even inside engines whose own
loggers do not propagate foreign records (vLLM)."""

from __future__ import annotations

import logging
import threading

from kda_backend import env

_LOGGER_NAME = "kda_backend"
# Our handler's name: the logger is set up when it lacks this handler, whatever handlers others attached.
_HANDLER_NAME = "kda-backend-stderr"
_warned: set[str] = set()
_setup_lock = threading.Lock()


def _set_up(logger: logging.Logger) -> bool:
    return any(h.get_name() == _HANDLER_NAME for h in logger.handlers)


def get_logger() -> logging.Logger:
    """The ``kda_backend`` logger, set up on first use at ``KDA_BACKEND_LOG_LEVEL`` (INFO, with one warning, when
    that value is not a level)."""
    logger = logging.getLogger(_LOGGER_NAME)
    if not _set_up(logger):
        with _setup_lock:
            if not _set_up(logger):
                level, problem = env.log_level()
                handler = logging.StreamHandler()
                handler.set_name(_HANDLER_NAME)
                handler.setFormatter(logging.Formatter("[kda-backend] %(levelname)s %(message)s"))
                logger.setLevel(level)
                logger.propagate = False
                logger.addHandler(handler)
                if problem:
                    logger.warning(problem)
    return logger


def _first(key: str) -> bool:
    if key in _warned:
        return False
    _warned.add(key)
    return True


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if _first(key):
        get_logger().warning(message)


def error_once(key: str, message: str) -> None:
    """Log ``message`` as an error the first time ``key`` is seen in this process."""
    if _first(key):
        get_logger().error(message)


def info_once(key: str, message: str) -> None:
    """Log ``message`` at INFO the first time ``key`` is seen in this process."""
    if _first(key):
        get_logger().info(message)


def debug_once(key: str, message: str) -> None:
    """Log ``message`` at DEBUG the first time ``key`` is seen in this process."""
    if _first(key):
        get_logger().debug(message)
