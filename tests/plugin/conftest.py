"""Fixtures shared by the platform's in-process tests."""

from __future__ import annotations

import logging

import pytest


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def plugin_log():
    """The plugin's log lines. vLLM's logging set-up (dictConfig) clears the handlers of
    every logger below `vllm`, so apply it first; EngineArgs then leaves it alone."""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging_if_needed

    configure_logging_if_needed(LoggingConfig())
    logger = logging.getLogger("vllm.neuron_plugin")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)
