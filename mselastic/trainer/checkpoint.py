"""Checkpoints that survive crashes at any instant, and a resume that never trusts a bad one.

Layout in the job's checkpoint folder::

    ckpt-00000120.ckpt    MindSpore checkpoint (crc_check on save and load)
    ckpt-00000120.json    manifest: step, data position (epoch, seed, global sample cursor),
                          world size, generation, sha256, size
    latest.json           pointer to the newest complete manifest

A checkpoint is complete once its manifest exists: the ``.ckpt`` is written and
fsynced first, then the manifest (temp file, fsync, rename), then the pointer,
then the folder is fsynced; a save killed anywhere in between leaves the previous
checkpoint the newest complete one. Only rank 0 writes (data parallel: every rank
holds the same parameters). The manifest also carries MindSpore's random state,
restored by ``load`` (dropout masks continue as if never interrupted).

Between checkpoints the first local rank of every node keeps a *snapshot* of the same state
every ``snapshot_interval_steps`` in a folder in memory the agent gives it (tmpfs, the node's
own: ``MSELASTIC_SNAPSHOT_DIR``): the parameters' raw bytes written on the training thread (one
copy from the device into that memory, and a CRC32), then their manifest; the newest two kept.
Not in the background, not through MindSpore's writer: a snapshot is complete when ``snapshot``
returns, so a rank killed at any instant leaves the previous step's at worst, and none waits
behind a checkpoint MindSpore is writing (it writes one at a time; with background snapshots, a
kill just after a checkpoint once lost two steps). A rank's death does not take them with it;
the next generation's rank 0, before the ranks agree, turns the newest one on its node into an
ordinary checkpoint (converted, checked, published like any save) when it is newer than every
checkpoint of the job, was taken by the generation that owns the folder (or a later one) and
continues the folder's lineage (a random id ``latest.json`` keeps from its first pointer on): a
crash then costs the steps since the last snapshot, not since the last checkpoint (DLRover's
flash checkpoint: the copy in the node's memory is the snapshot, persisted off the training path).
A snapshot costs the training thread at most ``SNAPSHOT_BUDGET`` of its time at any model size:
one is taken only once the training since the last has run ``1 / SNAPSHOT_BUDGET`` times as long
as that one cost the thread (its CPU time: a copy descheduled on a busy machine is not a dearer
copy), so a model whose copy takes longer than a twentieth of a step
gets one every few steps instead of every step, and a crash costs those few.

``load`` makes every rank resume from the same checkpoint: rank 0 proposes its
candidates (the pointer's, then the newest first), each rank tries to load the
proposal, and the first one every rank loaded is taken (two allreduces per
proposal). A rank that cannot load one (a checksum or CRC failure, an I/O error,
a directory that is not really shared) makes all of them go on to the previous
one, and the reasons are reported. When checkpoints of the job exist but none
loads on every rank, or the checkpoint directory is full, the rank leaves with
``FATAL_EXIT_CODE`` and the reason: the job fails instead of starting again from
step 0 (and pruning the checkpoints that could not be read). The last ``keep``
checkpoints are kept.

The files' names, the manifest and the atomic writes are :mod:`mselastic.trainer.layout`'s; what
a checkpoint holds of MindSpore's (parameters, dtypes, the random state),
:mod:`mselastic.trainer.tensors`'s; the snapshots' bytes, :mod:`mselastic.trainer.snapshots`'; how
the ranks agree on the one to resume from, :mod:`mselastic.trainer.agreement`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import glob
import json
import logging
import os
import shutil
import time
import uuid
from typing import Any, NoReturn

from mselastic.core.contract import LATEST_CHECKPOINT
from mselastic.trainer import agreement, snapshots
from mselastic.trainer.layout import MANIFEST, Manifest, Resumed, file_stem, fsync_file, sha256, write_atomic
from mselastic.trainer.tensors import as_tensors, parameters_of, rng_state

#: The share of the training thread's time snapshots may take (see the module's notes): with a
#: snapshot's copy at 5 % of a step or less, one every ``snapshot_interval_steps``; past that,
#: fewer (a 1 GiB state's second-long copy on a 0.5 s step: one every ~40 steps, not a 3x slower job).
SNAPSHOT_BUDGET = 0.05

log = logging.getLogger("mselastic.trainer")


class Checkpointer:
    """Checkpoints of one job in its ``checkpoint_dir``, fenced by generation.

    ``latest.json`` names the newest published manifest and the generation that owns the
    directory. Rank 0 of a generation claims it when it loads (before its first save), and a
    writer never moves it back to an older generation: the ranks of a generation that was
    replaced while cut off (a partition, a stall) may still reach the shared storage, and their
    saves are then withdrawn instead of published over the newer generation's. File names carry
    the generation too, so two generations never write the same file."""

    def __init__(self, directory: str, rank: int, world_size: int, generation: int, keep: int = 3,
                 job: str = "", ctx: Any = None, snapshot_dir: str = "", snapshot_interval: int = 0,
                 keeper: bool = False, snapshot_budget: float | None = SNAPSHOT_BUDGET) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        #: This node's in-memory folder for snapshots ("": none), every how many steps, and
        #: whether this rank takes them (see the module's notes).
        self.snapshot_dir = snapshot_dir
        self.snapshot_interval = snapshot_interval
        self.keeper = keeper
        #: The share of the training thread snapshots may take; None: one every interval, whatever it costs.
        self.snapshot_budget = snapshot_budget
        self._lineage: str | None = None
        #: The last snapshot kept: its step, what it cost the training thread (its CPU time), when
        #: it ended (monotonic); and whether thinning them was said in the log.
        self._last_snapshot: tuple[int, float, float] | None = None
        self._thinned = False
        self.dir = directory
        self.rank = rank
        self.world_size = world_size
        self.generation = generation
        self.keep = keep
        self.job = job
        #: The ElasticContext (its allreduce agrees on the checkpoint, its ``fatal`` reports);
        #: None: this process alone (tests, tools), which decides by itself.
        self.ctx = ctx
        os.makedirs(directory, exist_ok=True)

    @classmethod
    def from_context(cls, ctx: Any) -> "Checkpointer":
        job = ctx.job if ctx.generation else ""  # plain msrun (generation 0): no owner to check
        return cls(ctx.checkpoint_dir, ctx.rank, ctx.world_size, ctx.generation, ctx.keep_checkpoints, job, ctx,
                   snapshot_dir=ctx.snapshot_dir, snapshot_interval=ctx.snapshot_interval_steps,
                   keeper=ctx.snapshot_keeper)

    def _fatal(self, reason: str) -> NoReturn:
        if self.ctx is not None:
            self.ctx.fatal(reason)
        raise SystemExit(f"mselastic: {reason}")

    def _fault_point(self, where: str, step: int) -> None:
        fault = getattr(self.ctx, "fault", None)
        if fault is not None:
            fault.at_point(where, self.rank, self.generation, step)

    def _latest(self) -> dict[str, Any]:
        try:
            with open(os.path.join(self.dir, LATEST_CHECKPOINT)) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _publish(self, manifest: str | None) -> bool:
        """Point latest at ``manifest`` (None: keep the pointer, claim the directory for this
        generation), under a lock, unless a newer generation of this job owns it. False: refused.
        Plain msrun (generation 0) is not fenced; another job's pointer is taken over (Submit
        refuses a checkpoint_dir that a job still existing uses, so that job was deleted)."""
        with open(os.path.join(self.dir, ".latest.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            current = self._latest()
            owner, same_job = current.get("generation", 0), current.get("job", "") in ("", self.job)
            if self.generation and same_job and isinstance(owner, int) and owner > self.generation:
                return False
            pointer = manifest or current.get("manifest")
            # The folder's lineage: made with its first pointer (or when another job's is taken
            # over), kept by every later one; snapshots carry it (see _adopt_snapshot).
            lineage = current.get("lineage") if same_job and isinstance(current.get("lineage"), str) else ""
            write_atomic(os.path.join(self.dir, LATEST_CHECKPOINT),
                          json.dumps({"manifest": pointer, "generation": self.generation, "job": self.job,
                                      "lineage": lineage or uuid.uuid4().hex}))
        return True

    def claim(self) -> None:
        """Rank 0 of a new generation: from now on no older generation publishes here."""
        if self.writer and self.generation and not self._publish(None):
            raise SystemExit(f"mselastic: generation {self._latest().get('generation')} already owns "
                             f"{self.dir}; this generation ({self.generation}) was replaced")
        if self.writer and self.generation:
            self._sweep()

    def _sweep(self) -> None:
        """Remove what saves killed midway left (temp files, a ``.ckpt`` without its manifest) by
        the generations before this one, which own nothing here any more. Only files whose name
        says an older generation: a newer one (this one was replaced) may be writing its own."""
        for path in glob.glob(os.path.join(self.dir, "ckpt-*-g*")):
            name = os.path.basename(path)
            stem = name.split(".", 1)[0]
            found = MANIFEST.match(stem + ".json")
            if not found or not found.group(2) or int(found.group(2)) >= self.generation:
                continue
            torn = ".tmp" in name[len(stem):] or (name.endswith(".ckpt") and not os.path.exists(
                os.path.join(self.dir, stem + ".json")))
            if torn:
                with contextlib.suppress(OSError):
                    os.remove(path)

    @property
    def writer(self) -> bool:
        return self.rank == 0

    def save(self, obj: Any, step: int, epoch: int, cursor: int = 0, seed: int = 0,
             extra: dict[str, Any] | None = None, rng: dict[str, Any] | None = None) -> Manifest | None:
        """Write a checkpoint of ``obj`` at ``step``; rank 0 only. ``obj``: the optimizer, whose
        parameters are the network's plus its own state (momentum buffers, learning rate, global
        step), so all of it is carried across relaunches; or a :func:`~mselastic.trainer.tensors.host_copy` (a list of
        ``{"name", "data"}``, the data numpy arrays or Tensors: values copied earlier, written by
        another thread, which then passes ``rng``, MindSpore's random state taken with them)."""
        if not self.writer:
            return None
        import mindspore as ms

        name = file_stem(step, self.generation)
        path = os.path.join(self.dir, name + ".ckpt")
        try:
            ms.save_checkpoint(as_tensors(obj), path, crc_check=True)
            fsync_file(path)
            manifest = Manifest(step=step, epoch=epoch, world_size=self.world_size, generation=self.generation,
                                file=name + ".ckpt", sha256=sha256(path), size=os.path.getsize(path),
                                cursor=cursor, seed=seed, extra=extra or {}, job=self.job,
                                rng=rng if rng is not None else rng_state())
            write_atomic(os.path.join(self.dir, name + ".json"), manifest.to_json(),
                          midway=lambda: self._fault_point("save", step))
            published = self._publish(name + ".json")
        except (OSError, RuntimeError) as e:
            self._withdraw(name)
            if not self._full(e):
                raise
            last = self._latest().get("manifest") or "none"
            self._fatal(f"checkpoint_dir {self.dir} is full ({self._free()} free): the checkpoint of step {step} "
                        f"could not be written ({e}); free space there, then submit the job again: it resumes from "
                        f"the newest complete checkpoint ({last})")
        if not published:
            # Replaced while cut off: withdraw the files, nobody may resume from them.
            self._withdraw(name)
            log.error("checkpoint of step %d withdrawn: generation %s owns %s, this one (%d) was replaced",
                      step, self._latest().get("generation"), self.dir, self.generation)
            return None
        fsync_file(self.dir)
        self._prune()
        return manifest

    # -- snapshots between checkpoints ------------------------------------------

    def snapshot(self, obj: Any, step: int, epoch: int, cursor: int = 0, seed: int = 0,
                 extra: dict[str, Any] | None = None) -> bool:
        """Keep a snapshot of ``obj`` (the optimizer, or a list of cells and optimizers) at ``step`` in this
        node's in-memory folder, when this rank keeps them and one is due: complete when this
        returns (see the module's notes). True: one was kept."""
        if not (self.snapshot_dir and self.keeper and self.snapshot_interval > 0) or step % self.snapshot_interval:
            return False
        if self._lineage is None:  # (read once: rank 0 claimed the folder before the first step)
            lineage = self._latest().get("lineage")
            self._lineage = lineage if isinstance(lineage, str) else ""
            if not self._lineage:
                log.warning("no snapshots: %s has no lineage yet (no checkpoint of this job was published there)",
                            self.dir)
        if not self._lineage:
            return False
        started, cpu = time.monotonic(), time.thread_time()
        if not self._within_budget(step, started):
            return False
        params = parameters_of(list(obj) if isinstance(obj, (list, tuple)) else [obj])
        try:
            self._write_snapshot(params, step, epoch, cursor, seed, extra or {}, rng_state())
        except Exception as e:  # noqa: BLE001 - a snapshot is an optimisation: the checkpoints stand
            log.warning("snapshot of step %d not kept (%s)", step, e)
            return False
        finally:  # (a failed one cost the thread too: the next waits its turn all the same)
            # Its cost is the training thread's CPU time, not the wall clock's: on a busy machine a
            # 1 ms copy can take 30 ms of wall time descheduled, which is not the copy's cost.
            self._last_snapshot = (step, time.thread_time() - cpu, time.monotonic())
        return True

    def _within_budget(self, step: int, now: float) -> bool:
        """Whether the training since the last snapshot ran long enough to pay for one more
        (:data:`SNAPSHOT_BUDGET`); the first is always taken (it measures what one costs)."""
        if self._last_snapshot is None or not self.snapshot_budget:
            return True
        last_step, cost, ended = self._last_snapshot
        budget = self.snapshot_budget
        if now - ended >= cost / budget:
            return True
        if not self._thinned and step > last_step:
            self._thinned = True
            per_step = (now - ended) / (step - last_step)
            log.warning("snapshots thinned: one costs %.0f ms of the training thread's CPU, %.0f%% of a %.0f ms step; one "
                        "is kept once %.1f s of training has passed since the last (%.0f%% of the thread at most): "
                        "a crash may cost about %d steps (raise snapshot_interval_steps to choose)", cost * 1e3,
                        100 * cost / max(per_step, 1e-9), per_step * 1e3, cost / budget,
                        100 * budget, max(1, round(cost / budget / max(per_step, 1e-9))))
        return False

    def _write_snapshot(self, params: dict[str, Any], step: int, epoch: int, cursor: int, seed: int,
                        extra: dict[str, Any], rng: dict[str, Any]) -> None:
        """``params`` (name -> a Parameter, Tensor or numpy array) kept as this rank's snapshot of ``step``."""
        def manifest(file: str, size: int, tensors: list[dict[str, Any]], crc: int) -> Manifest:
            return Manifest(step=step, epoch=epoch, world_size=self.world_size, generation=self.generation,
                            file=file, sha256="", size=size, cursor=cursor, seed=seed, extra=extra, job=self.job,
                            rng=rng, lineage=self._lineage or "", tensors=tensors, crc32=crc)

        snapshots.write(self.snapshot_dir, file_stem(step, self.generation), params, manifest, self.generation)

    def _adopt_snapshot(self) -> None:
        """Rank 0 of a new generation: the newest snapshot on this node becomes a checkpoint when it
        is newer than every checkpoint of the job, continues the folder's lineage (not the same job
        name's in another folder, or from before etcd was wiped) and was taken by the generation
        that owns the folder or a later one (a replaced generation's, cut off and training on, is not). Copied, checked and
        published as a save is; anything wrong and the checkpoints are resumed from as they are."""
        if not (self.writer and self.generation and self.snapshot_dir and os.path.isdir(self.snapshot_dir)):
            return
        newest_step = max((int(found.group(1)) for n in self.manifests() if (found := MANIFEST.match(n))
                           and self._owner(n) in ("", self.job)), default=-1)
        owner = self._latest()
        if owner.get("job", "") not in ("", self.job) or not owner.get("lineage"):
            return  # another job's folder, or one whose history no snapshot can continue
        owner_gen = owner.get("generation", 0)
        for m in snapshots.adoptable(self.snapshot_dir, self.job, self.generation, owner["lineage"],
                                     owner_gen if isinstance(owner_gen, int) else 0, newest_step):
            if self._persist(m):
                return

    def _persist(self, m: Manifest) -> bool:
        """Write the snapshot ``m`` into the checkpoint folder as a MindSpore checkpoint, checked (size,
        CRC32) and published as a save is. False (logged, nothing left behind) when it cannot be."""
        import mindspore as ms

        stem = m.file.rsplit(".", 1)[0]
        if not m.file.endswith(".snap"):
            log.warning("snapshot of step %d is in the format of an earlier mselastic (%s): not adopted", m.step,
                        m.file)
            return False
        dst = os.path.join(self.dir, stem + ".ckpt")
        tmp = os.path.join(self.dir, f"{stem}.tmp{os.getpid()}.ckpt")  # (MindSpore loads only *.ckpt)
        try:
            values = snapshots.tensors_of(self.snapshot_dir, m)
            ms.save_checkpoint(values, tmp, crc_check=True)
            fsync_file(tmp)
            os.replace(tmp, dst)
            kept = dataclasses.replace(m, file=stem + ".ckpt", sha256=sha256(dst), size=os.path.getsize(dst),
                                       tensors=[], crc32=0)
            write_atomic(os.path.join(self.dir, stem + ".json"), kept.to_json())
            if not self._publish(stem + ".json"):
                raise ValueError("a newer generation owns the folder")
            fsync_file(self.dir)
        except agreement.UNUSABLE as e:
            for litter in (tmp, tmp[: -len(".ckpt")] + ".tmp"):  # (MindSpore writes <name>.tmp first)
                with contextlib.suppress(OSError):
                    os.remove(litter)
            self._withdraw(stem)
            log.warning("snapshot of step %d not kept as a checkpoint (%s)", m.step, e)
            return False
        log.warning("the snapshot of step %d (generation %d) on this node is newer than every checkpoint: kept as "
                    "%s", m.step, m.generation, stem + ".json")
        return True

    def _withdraw(self, name: str) -> None:
        """Remove a checkpoint that was not published (its files, its manifest's temp file)."""
        # (MindSpore writes ``<name>.tmp`` first and leaves it when the write fails.)
        for path in [os.path.join(self.dir, name + s) for s in (".json", ".ckpt", ".tmp")] + \
                glob.glob(os.path.join(self.dir, name + ".json.tmp.*")):
            with contextlib.suppress(OSError):
                os.remove(path)

    def _free(self) -> str:
        try:
            return f"{shutil.disk_usage(self.dir).free} bytes"
        except OSError:
            return "? bytes"

    def _full(self, error: Exception) -> bool:
        """Whether a failed save failed because the checkpoint filesystem is full (MindSpore's own
        writer raises a RuntimeError without the errno: then the free space decides)."""
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        try:
            newest = max((os.path.getsize(p) for p in glob.glob(os.path.join(self.dir, "ckpt-*.ckpt"))), default=0)
            return shutil.disk_usage(self.dir).free < max(newest, 1 << 20)
        except OSError:
            return False

    def manifests(self) -> list[str]:
        """Manifest file names, newest step first."""
        names = [os.path.basename(p) for p in glob.glob(os.path.join(self.dir, "ckpt-*.json"))]
        return sorted((n for n in names if MANIFEST.match(n)), reverse=True)

    def _prune(self) -> None:
        """Keep the newest ``keep`` of this job's checkpoints (another job's files are not ours)."""
        for name in [n for n in self.manifests() if self._owner(n) in ("", self.job)][self.keep:]:
            stem = name[: -len(".json")]
            for suffix in (".json", ".ckpt"):
                try:
                    os.remove(os.path.join(self.dir, stem + suffix))
                except FileNotFoundError:
                    pass

    def _owner(self, name: str) -> str:
        try:
            with open(os.path.join(self.dir, name)) as f:
                job = json.load(f).get("job", "")
            return job if isinstance(job, str) else ""
        except (OSError, ValueError, AttributeError):
            return ""

    def load(self, restore_rng: bool = True) -> Resumed | None:
        """The newest valid checkpoint of this job, or None for a fresh start. Rank 0 then claims
        the directory for this generation (see :meth:`claim`). MindSpore's random state is restored
        from it unless ``restore_rng`` is False (then :meth:`Resumed.restore_rng`, once the network
        is built: building it consumes seeds)."""
        try:
            self._adopt_snapshot()
            resumed = self._load()
        finally:
            self.claim()
        if resumed is not None and restore_rng:
            resumed.restore_rng()
        return resumed

    def _candidates(self) -> list[str]:
        """This job's manifests this rank sees: the pointer's first, then the newest first."""
        order = [n for n in self.manifests() if self._owner(n) in ("", self.job)]
        pointed = self._latest().get("manifest")
        if pointed in order:
            order.remove(pointed)
            order.insert(0, pointed)
        return order

    def _read(self, name: str) -> tuple[Manifest, dict[str, Any]]:
        """The manifest ``name`` and its parameters, checked (job, size, sha256, CRC); raises one of
        ``agreement.UNUSABLE``."""
        import mindspore as ms

        with open(os.path.join(self.dir, name)) as f:
            m = Manifest(**json.load(f))
        if m.job and self.job and m.job != self.job:
            raise ValueError(f"written by job {m.job}, not {self.job}")
        path = os.path.join(self.dir, m.file)
        if os.path.getsize(path) != m.size or sha256(path) != m.sha256:
            raise ValueError("checksum mismatch")
        return m, ms.load_checkpoint(path, crc_check=True)

    def _load(self) -> Resumed | None:
        if self.ctx is None or self.ctx.world_size == 1:
            return self._load_alone(self._candidates())
        return self._load_agreed(self._candidates())

    def _resumed(self, m: Manifest, params: dict[str, Any], skipped: list[tuple[str, str]]) -> Resumed:
        if skipped:
            log.warning("resuming from %s (step %d) instead of newer %s", m.file, m.step,
                        ", ".join(n for n, _ in skipped))
        return Resumed(m, params, tuple(skipped))

    def _none_usable(self, skipped: list[tuple[str, str]]) -> NoReturn:
        why = "; ".join(f"{n}: {w}" for n, w in skipped) or "none proposed"
        self._fatal(f"checkpoints of job {self.job or '(unnamed)'} exist in {self.dir} but none can be resumed from "
                    f"by every rank ({why}); not starting again from step 0. Repair or remove them, then submit the job again")

    def _load_alone(self, order: list[str]) -> Resumed | None:
        skipped: list[tuple[str, str]] = []
        for name in order:
            try:
                return self._resumed(*self._read(name), skipped)
            except agreement.UNUSABLE as e:
                log.warning("checkpoint %s unusable (%s); trying the previous one", name, e)
                skipped.append((name, str(e)))
        if skipped:
            self._none_usable(skipped)
        return None

    def _load_agreed(self, order: list[str]) -> Resumed | None:
        """Rank 0 proposes, every rank tries, the first checkpoint all of them loaded is taken
        (:func:`mselastic.trainer.agreement.agree`)."""
        assert self.ctx is not None
        world = self.ctx.world_size
        loaded, skipped, seen = agreement.agree(self.ctx.allreduce, self.rank, world, order, self._read)
        if loaded is not None:
            return self._resumed(*loaded, skipped)
        if seen:
            if not skipped:
                skipped.append(("-", f"rank 0 sees no checkpoint of the job, {seen} of {world} rank(s) do: "
                                     f"checkpoint_dir is not the same directory on every node"))
            self._none_usable(skipped)
        return None
