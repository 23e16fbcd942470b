"""The named retry policies (mselastic.core.retries): what each retries, how often, until when."""

from __future__ import annotations

import asyncio
import time

import pytest
import tenacity

from mselastic.core import retries


def test_polling_asks_again_while_not_yet_and_gives_up_after_its_time() -> None:
    answers = iter([True, True, False])
    assert retries.polling(5, every_s=0.01, sync=True)(lambda: next(answers)) is False
    t0 = time.monotonic()
    with pytest.raises(tenacity.RetryError) as e:
        retries.polling(0.1, every_s=0.02, sync=True)(lambda: ["still here"])
    assert 0.1 <= time.monotonic() - t0 < 1.0 and e.value.last_attempt.result() == ["still here"]
    assert asyncio.run(_async(retries.polling(0.05, every_s=0.01, quietly=True), lambda: "late")) == "late"


def test_until_no_error_tries_again_only_on_its_errors_then_raises_the_last() -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("not yet")
        return "up"

    assert retries.until_no_error(ConnectionError, 5, every_s=0.01, sync=True)(flaky) == "up" and len(calls) == 3
    with pytest.raises(ValueError):  # (not one of its errors: at once)
        retries.until_no_error(ConnectionError, 5, every_s=0.01, sync=True)(_raise(ValueError("bad")))
    with pytest.raises(ConnectionError):
        retries.until_no_error(ConnectionError, 0.05, every_s=0.01, sync=True)(_raise(ConnectionError("down")))
    stopped = asyncio.run(_async(retries.until_no_error(OSError, 60, jitter_s=(0.01, 0.02), done=lambda: True),
                                 _raise(OSError("refused")), expect=OSError))
    assert isinstance(stopped, OSError)  # (done(): no minute of retries)


def test_on_conflict_tries_its_attempts_and_backing_off_stops_when_done() -> None:
    calls: list[int] = []

    async def conflicting() -> None:
        async for attempt in retries.on_conflict(KeyError, attempts=4):
            with attempt:
                calls.append(1)
                raise KeyError("lost the race")

    with pytest.raises(KeyError):
        asyncio.run(conflicting())
    assert len(calls) == 4
    told: list[float] = []
    t0 = time.monotonic()
    result = asyncio.run(_async(retries.backing_off(OSError, first_s=0.01, max_s=0.02, within_s=0.2,
                                                    before_sleep=lambda rs: told.append(rs.upcoming_sleep)),
                                _raise(OSError("gone")), expect=OSError))
    assert isinstance(result, OSError) and told and max(told) <= 0.02 and time.monotonic() - t0 < 2


def _raise(error: BaseException):  # type: ignore[no-untyped-def]
    def fn() -> None:
        raise error
    return fn


async def _async(policy, fn, expect: type[BaseException] | None = None):  # type: ignore[no-untyped-def]
    async def call():  # type: ignore[no-untyped-def]
        return fn()
    try:
        return await policy(call)
    except BaseException as e:
        if expect is not None and isinstance(e, expect):
            return e
        raise
