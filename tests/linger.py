"""A training script's wrapper for tests: ``python tests/linger.py <script> <args...>`` runs the
script, and rank ``R`` (``MSELASTIC_TEST_LINGER="R:SECONDS:FILE"``) stays SECONDS at exit before it
leaves, then writes the time it left to FILE: a rank slow to exit, still connected to the scheduler.
With ``MSELASTIC_TEST_DEAF_TO_TERM=R`` rank R ignores SIGTERM (the handler the trainer sets is
replaced by SIG_IGN): a rank stuck where Python runs no handler, slow to stop on a planned stop.
MindSpore leaves the cluster in an exit handler its native module registers at import
(``ClearResAtexit``); handlers run last registered first, so this one is registered after the import
and runs before MindSpore's (and after the trainer's, registered later still)."""

import atexit
import os
import runpy
import signal
import sys
import time

import mindspore  # noqa: F401  (its exit handlers first: see above)


def _linger() -> None:
    rank, seconds, path = os.environ["MSELASTIC_TEST_LINGER"].split(":", 2)
    if os.environ.get("RANK_ID") == rank:
        time.sleep(float(seconds))
        with open(path, "w") as f:
            f.write(repr(time.time()))


if os.environ.get("MSELASTIC_TEST_LINGER"):
    atexit.register(_linger)
if os.environ.get("MSELASTIC_TEST_DEAF_TO_TERM") == os.environ.get("RANK_ID", "-"):
    _set = signal.signal

    def _deaf(signum, handler):  # type: ignore[no-untyped-def]
        return _set(signum, signal.SIG_IGN if signum == signal.SIGTERM else handler)

    signal.signal = _deaf  # type: ignore[assignment]
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
