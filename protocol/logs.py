"""The JSON log format of the daemon and the HTTP adapter: one object per line on stderr, journald and `jq` friendly.

Here, below both, so that neither imports the other for it. A record's `fields` extra (a dict) becomes top-level
keys. Prompt text is never logged.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "msg": record.getMessage(),
               **getattr(record, "fields", {})}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def log_json(names: Iterable[str], level: str) -> None:
    """Send these loggers' records, at `level` and above, to stderr as JSON lines (and nowhere else)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    for name in names:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
