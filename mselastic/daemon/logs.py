"""Structured logs: every line names the job, generation, node and rank it is about.

Callers pass those as ``extra={...}``; missing ones print as ``-``. ``--log-format
json`` prints one JSON object per line for log collectors. Under systemd, when stderr is the
journal (``$JOURNAL_STREAM`` names stderr's device and inode), records go to journald
natively instead, with JOB, GENERATION, NODE and RANK as fields
(``journalctl -u elasticd JOB=lenet``, ``-o json``).
"""

from __future__ import annotations

import json
import logging
import os
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


def stderr_is_journal() -> bool:
    """systemd's documented test: $JOURNAL_STREAM is ``device:inode`` of the journal stream, and
    stderr is that stream (not redirected elsewhere by a wrapper)."""
    try:
        device, inode = (int(v) for v in os.environ.get("JOURNAL_STREAM", "").split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (device, inode)


#: syslog priorities of the logging levels (journald's PRIORITY field).
PRIORITIES = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


class _Journal(logging.Handler):
    """One journal entry per record, through libsystemd's sd_journal_send (cysystemd): the
    message, its priority, the logger, and JOB, GENERATION, NODE, RANK; nothing else of the
    record (no arguments, no paths). A failed send is logging's to report, not the caller's."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from cysystemd.journal import send
            send(message=self.format(record), priority=PRIORITIES.get(record.levelno, 6),
                 syslog_identifier="elasticd", logger=record.name,
                 **{f: str(getattr(record, f)) for f in FIELDS})
        except Exception:
            self.handleError(record)


def setup(node: str, fmt: str, level: str = "INFO") -> None:
    handler: logging.Handler
    if stderr_is_journal():
        handler = _Journal()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_Context(node))
    if isinstance(handler, logging.StreamHandler) and fmt == "json":
        handler.setFormatter(_Json())
    elif isinstance(handler, logging.StreamHandler):
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s job=%(job)s gen=%(generation)s node=%(node)s rank=%(rank)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
