"""What a job may put where elasticd reads (a FIFO, a link to a device, a huge file, storage that
hangs) is refused at once or given up on within the deadline, never waited for."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from mselastic.agent.containment import jobfiles
from mselastic.agent.containment.jobfiles import IN_FLIGHT, Unreadable, bounded, read_small


def test_only_a_small_regular_file_is_read(tmp_path: os.PathLike[str]) -> None:
    tmp = str(tmp_path)
    ok = os.path.join(tmp, "latest.json")
    with open(ok, "w") as f:
        f.write('{"manifest": "m.json"}')
    assert read_small(ok) == b'{"manifest": "m.json"}'
    fifo = os.path.join(tmp, "fifo")
    os.mkfifo(fifo)  # nobody writes: a plain open() would never return
    link = os.path.join(tmp, "zero")
    os.symlink("/dev/zero", link)
    huge = os.path.join(tmp, "huge")
    with open(huge, "wb") as f:
        f.truncate(10 << 30)  # sparse: 10 GiB of zeros on no disk
    started = time.monotonic()
    for path, why in ((fifo, "not a regular file"), (huge, "larger than")):
        with pytest.raises(Unreadable, match=why):
            read_small(path)
    with pytest.raises(OSError):  # ELOOP: a final symlink is never followed
        read_small(link)
    assert time.monotonic() - started < 1.0


def test_a_read_that_hangs_is_given_up_on_and_stuck_ones_are_capped() -> None:
    release = threading.Event()

    async def main() -> None:
        started = time.monotonic()
        with pytest.raises(Unreadable, match="no answer within"):
            await bounded(release.wait, within_s=0.2)  # (as a read of a hung NFS mount)
        assert time.monotonic() - started < 1.0
        stuck = [asyncio.ensure_future(bounded(release.wait, within_s=5.0)) for _ in range(IN_FLIGHT - 1)]
        await asyncio.sleep(0.1)
        with pytest.raises(Unreadable, match="not answering; not reading more"):
            await bounded(lambda: 1)  # every slot taken by a stuck read: refused at once, not queued
        release.set()
        await asyncio.gather(*stuck)
        assert await bounded(lambda: 2) == 2  # the slots came back

    asyncio.run(main())
    assert jobfiles._in_flight.acquire(blocking=False)
    jobfiles._in_flight.release()
