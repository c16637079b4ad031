"""One log format for every llmgw process: logfmt lines (`ts=... level=... logger=... msg="..."
model=...`), one event each, so an operator can grep a model's whole history across the watcher,
the routers and the node agents, and a log shipper can parse them without a custom pattern.

Fields passed with `extra={"model": ...}` are appended as key=value pairs.
"""

from __future__ import annotations

import logging
import sys
import time

from nomad_driver.redaction import redact

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


def _quote(value: object) -> str:
    text = str(value)
    if text and not any(c in text for c in ' "=\n\t'):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        parts = [
            f"ts={ts}",
            f"level={record.levelname.lower()}",
            f"logger={record.name}",
            f"msg={_quote(record.getMessage())}",
        ]
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                parts.append(f"{key}={_quote(value)}")
        if record.exc_info:
            parts.append(f"exc={_quote(self.formatException(record.exc_info))}")
        # Behind the validation that refuses credentials in sources: an engine's or a client
        # library's error may still quote a URL with one.
        return redact(" ".join(parts))


def configure_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # Client libraries log every request at INFO; at scale that drowns the events that matter.
    for noisy in ("httpx", "httpcore", "urllib3", "aiohttp.access", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
