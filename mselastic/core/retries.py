"""Every retry of mselastic, by what it is for: tenacity's policies, named once here (etcd's own,
with its budget from the settings, is ``store.etcd.RetryPolicy``). Each says what it retries, how
often and until when; the call sites say only which one and with what numbers.

- :func:`polling`: ask again every ``every_s`` while the answer is "not yet" (truthy), for
  ``within_s`` at most: a note the leader writes, a log file that is still to come, a drain.
- :func:`until_no_error`: try again every ``every_s`` (or at random within ``jitter_s``) while it
  raises one of ``errors``, for ``within_s`` at most: a port that is not listening yet, a leader
  not elected yet.
- :func:`on_conflict`: a compare-and-set that lost to another writer, ``attempts`` times.
- :func:`backing_off`: a source that failed, again after 1, 2, 4 ... ``max_s`` seconds, until
  ``within_s`` or until asked to stop.
"""

from __future__ import annotations

from typing import Any, Callable

import tenacity

Errors = type[BaseException] | tuple[type[BaseException], ...]


class stop_when(tenacity.stop.stop_base):
    """Stop retrying once ``done()`` says so (elasticd stopping, the generation stopped)."""

    def __init__(self, done: Callable[[], bool]) -> None:
        self.done = done

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self.done()


def _stop(within_s: float | None, done: Callable[[], bool] | None) -> Any:
    stop: Any = tenacity.stop_after_delay(within_s) if within_s is not None else tenacity.stop_never
    return stop | stop_when(done) if done is not None else stop


def polling(within_s: float, every_s: float, *, sync: bool = False, quietly: bool = False) -> Any:
    """Call again every ``every_s`` while the call returns something truthy ("not yet"), for
    ``within_s`` at most; then tenacity's RetryError (its last attempt holds the last answer), or,
    ``quietly``, that last answer returned. (``sync``: tenacity's Retrying, else AsyncRetrying.)"""
    kind: Any = tenacity.Retrying if sync else tenacity.AsyncRetrying
    last: Any = (lambda rs: rs.outcome.result() if rs.outcome else True) if quietly else None
    return kind(stop=tenacity.stop_after_delay(within_s), wait=tenacity.wait_fixed(every_s),
                retry=tenacity.retry_if_result(bool), retry_error_callback=last)


def until_no_error(errors: Errors, within_s: float, every_s: float = 0.0, *, jitter_s: tuple[float, float] | None = None,
                   done: Callable[[], bool] | None = None, sync: bool = False) -> Any:
    """Call again while it raises one of ``errors``: every ``every_s``, or at a random time within
    ``jitter_s`` (many callers at once), for ``within_s`` at most or until ``done()``; then the
    last error is raised."""
    wait = tenacity.wait_random(*jitter_s) if jitter_s is not None else tenacity.wait_fixed(every_s)
    kind: Any = tenacity.Retrying if sync else tenacity.AsyncRetrying
    return kind(stop=_stop(within_s, done), wait=wait, retry=tenacity.retry_if_exception_type(errors), reraise=True)


def on_conflict(errors: Errors, attempts: int, jitter_s: tuple[float, float] | None = None) -> tenacity.AsyncRetrying:
    """A compare-and-set that lost to another writer (``errors``), tried again ``attempts`` times in
    all (at a random time within ``jitter_s``: writers that collide once spread out); then the
    last conflict is raised."""
    return tenacity.AsyncRetrying(stop=tenacity.stop_after_attempt(attempts), reraise=True,
                                  wait=tenacity.wait_random(*jitter_s) if jitter_s else tenacity.wait_none(),
                                  retry=tenacity.retry_if_exception_type(errors))


def backing_off(errors: Errors, first_s: float, max_s: float, *, within_s: float | None = None,
                done: Callable[[], bool] | None = None,
                before_sleep: Callable[[tenacity.RetryCallState], None] | None = None) -> tenacity.AsyncRetrying:
    """A source that failed with one of ``errors``, tried again after ``first_s``, twice that, ...
    ``max_s`` at most, for ``within_s`` (None: no limit) or until ``done()``; then the last error is
    raised. ``before_sleep``: told of each failure (to log it)."""
    return tenacity.AsyncRetrying(stop=_stop(within_s, done), wait=tenacity.wait_exponential(first_s, max=max_s),
                                  retry=tenacity.retry_if_exception_type(errors), reraise=True,
                                  before_sleep=before_sleep or tenacity.before_sleep_nothing)
