"""``--log-format json``: one JSON object per record, extra fields included."""

from __future__ import annotations

import io
import json
import logging

import pytest

from kvdepot.errors import InvalidArgument
from kvdepot.logs import JsonFormatter, setup_logging


def _record(**kwargs: object) -> logging.LogRecord:
    logger = logging.getLogger("kvdepot.test")
    return logger.makeRecord(
        "kvdepot.test", logging.WARNING, __file__, 1, "node %s expired", ("a",), None, extra=kwargs
    )


def test_json_lines_carry_the_message_and_extra_fields() -> None:
    line = JsonFormatter().format(_record(event="node_expired", chunks=3, node="a"))
    assert "\n" not in line
    d = json.loads(line)
    assert d["level"] == "WARNING" and d["logger"] == "kvdepot.test"
    assert d["msg"] == "node a expired"
    assert d["ts"].endswith("+00:00") and "T" in d["ts"]
    assert (d["event"], d["chunks"], d["node"]) == ("node_expired", 3, "a")
    assert "args" not in d and "pathname" not in d


def test_exceptions_stay_on_one_line() -> None:
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        import sys

        rec = logging.getLogger("x").makeRecord(
            "x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    assert "ValueError: boom" in json.loads(line)["exc"]


def test_setup_logging_json_to_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        setup_logging("info", "json")
        logging.getLogger("kvdepot.x").info("hello %d", 1, extra={"event": "hi"})
        logging.getLogger("kvdepot.x").debug("not shown")
        (line,) = err.getvalue().splitlines()
        assert json.loads(line)["msg"] == "hello 1"
        with pytest.raises(InvalidArgument):
            setup_logging("info", "xml")
        with pytest.raises(InvalidArgument):
            setup_logging("loud", "text")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
