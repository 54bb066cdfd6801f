"""The JSON log format of the daemon and the HTTP adapter: one object per line on stderr, journald and `jq` friendly.

Here, below both, so that neither imports the other for it. A record's `fields` extra (a dict) becomes top-level
keys. Prompt text is never logged.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable
from pathlib import Path


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "msg": record.getMessage(),
               **getattr(record, "fields", {})}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


# A log file the program writes itself (`m31r daemon --log-file`) is moved to FILE.1 past this size: a daemon kept
# running for months by launchd writes a line per request, and nothing on macOS rotates a user agent's log.
LOG_FILE_BYTES = 10 << 20


def log_json(names: Iterable[str], level: str, file: str | Path | None = None) -> None:
    """Send these loggers' records, at `level` and above, as JSON lines to stderr, or to `file` (rotated past
    LOG_FILE_BYTES, one older copy kept), and nowhere else."""
    handler: logging.Handler
    if file is None:
        handler = logging.StreamHandler(sys.stderr)
    else:
        from logging.handlers import RotatingFileHandler

        Path(file).parent.mkdir(parents=True, exist_ok=True)
        handler = RotatingFileHandler(file, maxBytes=LOG_FILE_BYTES, backupCount=1, encoding="utf-8")
    handler.setFormatter(JsonFormatter())
    for name in names:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
