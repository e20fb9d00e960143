"""The server's log lines: llmc's loggers print beside uvicorn's, at the level `--log-level` names."""

from __future__ import annotations

import logging

import pytest

from llmc.errors import InputError
from llmc.serve.logs import LogLevel, log_level_of, show_llmc_logs


@pytest.fixture
def llmc_logger() -> logging.Logger:
    logger = logging.getLogger("llmc")
    handlers, level = list(logger.handlers), logger.level
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


def test_llmc_lines_print_in_uvicorn_s_format_at_the_server_s_level(llmc_logger: logging.Logger,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    llmc_logger.handlers[:] = []
    handler = show_llmc_logs("warning")
    assert show_llmc_logs(LogLevel.info) is handler and llmc_logger.handlers == [handler]  # once per process
    logging.getLogger("llmc.runtime").info("KV memory: 64 MB mapped at start-up in 0.1 s")
    logging.getLogger("llmc.runtime").debug("not at info")
    assert capsys.readouterr().err == "INFO:     KV memory: 64 MB mapped at start-up in 0.1 s\n"
    show_llmc_logs("trace")
    assert llmc_logger.level == 5  # uvicorn's TRACE, below DEBUG


@pytest.mark.parametrize(("given", "number"), [("critical", 50), ("ERROR", 40), ("warning", 30), ("info", 20),
                                               ("debug", 10), (LogLevel.trace, 5)])
def test_every_uvicorn_level_is_a_logging_level(given: str, number: int) -> None:
    assert log_level_of(given).number == number


def test_an_unknown_level_names_the_choices() -> None:
    with pytest.raises(InputError, match="log level must be one of critical, error, warning, info, debug, trace, "
                                         "got 'verbose'") as e:
        log_level_of("verbose")
    assert e.value.param == "log_level"
