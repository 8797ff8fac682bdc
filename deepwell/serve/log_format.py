"""How `deepwell serve` and its workers write log lines: readable text, or one JSON object a
line (`--log-format json`) whose request lines carry the request log's fields as their own."""

from __future__ import annotations

import json
import logging
import time

TEXT_FORMAT = "%(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message (and a request's fields)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request = getattr(record, "request", None)
        if request is not None:
            line.update(request)
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(level: str, log_format: str) -> None:
    """The process's log lines at `level` (debug, info, ...) in `log_format` (text or json)."""
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
