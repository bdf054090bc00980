"""The ``tokenmill`` logger, set up as vLLM's ``vllm.logger``: on import, a stderr handler at
INFO that does not propagate to the root logger. ``TOKENMILL_LOGGING_LEVEL`` sets the level
(``DEBUG``, ``INFO``, ``WARNING``, ...); ``TOKENMILL_CONFIGURE_LOGGING=0`` leaves the
``tokenmill`` logger to the application's logging configuration."""

from __future__ import annotations

import logging
import sys

from tokenmill import envs

LOGGER_NAME = "tokenmill"
FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


def configure_logging() -> None:
    """Give the ``tokenmill`` logger its stderr handler and level (once); raises
    ``ValueError`` for an unknown ``TOKENMILL_LOGGING_LEVEL``."""
    if not envs.TOKENMILL_CONFIGURE_LOGGING:
        return
    level = envs.TOKENMILL_LOGGING_LEVEL.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(
            f"TOKENMILL_LOGGING_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {level!r}"
        )
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    logger.propagate = False
    if not any(isinstance(h, _Handler) for h in logger.handlers):
        handler = _Handler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        logger.addHandler(handler)


class _Handler(logging.StreamHandler):
    """The handler ``configure_logging`` adds, told apart from the application's."""
