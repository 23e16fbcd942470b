"""The reporter (mselastic.agent.reports) keeps writing whatever a write raised. A fake store: no
etcd, no processes."""

from __future__ import annotations

import asyncio
import types

from mselastic.agent.reports import Reports
from mselastic.store.etcd import TemporaryError
from mselastic.store.keys import Keys


class FlakyStore:
    """Raises each of ``errors`` on a put in turn, then takes the writes."""

    def __init__(self, *errors: Exception) -> None:
        self.keys, self.errors, self.written = Keys(), list(errors), {}

    async def put(self, key: str, value: str) -> None:
        if self.errors:
            raise self.errors.pop(0)
        self.written[key] = value


def generation(step: list[int]) -> object:
    return types.SimpleNamespace(plan=types.SimpleNamespace(job="j", generation=1),
                                 report=lambda: types.SimpleNamespace(to_json=lambda: f'{{"step": {step[0]}}}'))


def test_a_write_that_raised_anything_is_tried_again_and_the_reports_go_on() -> None:
    async def main() -> dict[str, str]:
        store = FlakyStore(TemporaryError("etcd away"), RuntimeError("an error of no foreseen kind"))
        reports, step, stop = Reports(store, "n0", 0.01), [1], asyncio.Event()  # type: ignore[arg-type]
        task = asyncio.create_task(reports.run(stop))
        gen = generation(step)
        reports.changed(gen)  # type: ignore[arg-type]
        for _ in range(200):
            if store.written:
                break
            await asyncio.sleep(0.01)
        step[0] = 2
        reports.changed(gen)  # type: ignore[arg-type]
        for _ in range(200):
            if '"step": 2' in "".join(store.written.values()):
                break
            await asyncio.sleep(0.01)
        stop.set()
        reports.changed(gen)  # type: ignore[arg-type]
        await asyncio.wait_for(task, 5)
        return store.written

    assert list(asyncio.run(main()).values()) == ['{"step": 2}']
