from __future__ import annotations

import logging

from nomad_driver.logs import LogfmtFormatter


def test_log_lines_are_logfmt_and_name_the_model() -> None:
    record = logging.LogRecord(
        "llmgw.watcher", logging.WARNING, __file__, 1, "model parked: %s", ("x y",), None
    )
    record.model = "kev-0.5b"
    line = LogfmtFormatter().format(record)
    assert line.startswith("ts=")
    assert 'level=warning logger=llmgw.watcher msg="model parked: x y" model=kev-0.5b' in line


def test_values_with_quotes_and_newlines_stay_on_one_line() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, 'said "no"\nthen left', None, None)
    line = LogfmtFormatter().format(record)
    assert "\n" not in line
    assert 'msg="said \\"no\\"\\nthen left"' in line
