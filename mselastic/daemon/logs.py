"""Structured logs: every line names the job, generation, node and rank it is about.

Callers pass those as ``extra={...}``; missing ones print as ``-``. ``--log-format
json`` prints one JSON object per line for log collectors.
"""

from __future__ import annotations

import json
import logging
import sys

FIELDS = ("job", "generation", "node", "rank")


class _Context(logging.Filter):
    def __init__(self, node: str) -> None:
        super().__init__()
        self.node = node

    def filter(self, record: logging.LogRecord) -> bool:
        for f in FIELDS:
            if not hasattr(record, f):
                setattr(record, f, self.node if f == "node" else "-")
        return True


class _Json(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
               **{f: getattr(record, f) for f in FIELDS}, "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup(node: str, fmt: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_Context(node))
    if fmt == "json":
        handler.setFormatter(_Json())
    else:
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s job=%(job)s gen=%(generation)s node=%(node)s rank=%(rank)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
