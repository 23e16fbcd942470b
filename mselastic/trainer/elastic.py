"""A MindSpore script made elastic with three added lines, for a loop of its own or ``Model.train``.

The classic data-parallel script (``init()``, a dataset sharded with ``num_shards``/``shard_id``,
``DATA_PARALLEL``, an optimizer, a loop over ``dataset.create_tuple_iterator()``) becomes elastic
by adding, and changing nothing::

    from mselastic.trainer import elastic       # first: reports init()'s start-up phases to elasticd
    ...
    dataset = elastic.data(dataset)             # after the dataset is built: this job's share of it
    ...
    elastic.track(optimizer)                    # after the optimizer: resume now, then save it

and ``Model.train`` users pass ``callbacks=[elastic.Callback()]`` instead of the third line. A
loop written for elastic training can say it in one place::

    elastic.track(optimizer)
    for data, label in elastic.batches(dataset):   # every step of the job, across epochs
        loss = train_step(data, label)
        elastic.step(loss)                          # the heartbeats carry the loss

What the lines do:

- **the import** wraps ``mindspore.communication.init`` (so it must come before the script
  imports ``init``): the rank dies with elasticd, reports its start-up phases (a rank stuck before
  or inside ``init()`` is found in seconds) and takes the agent's nudge out of MindSpore's 3 s
  address poll (``contract.NUDGE_SIGNAL``).
- **data(dataset)** takes the pipeline over, in place: its source (``MnistDataset``, any mappable
  dataset) gets a sampler of the job's sample stream (one permutation of the data set per epoch,
  drawn from the seed and the epoch, consumed ``global_batch_size`` samples per step; this rank gets
  its round-robin share of every step's) and its ``batch`` the per-rank batch of the job's
  ``global_batch_size`` at this world size (the script's own ``num_shards``, ``shard_id``, ``shuffle``
  and batch size are replaced: say so once). The resume point is agreed here, by every rank (the
  newest checkpoint every rank loads, see ``Checkpointer``): the stream starts where it left off.
  Each "epoch" MindSpore asks for is ``N // global_batch_size`` steps of the stream, so every
  sample of an epoch is consumed exactly once whatever the world size, and a resumed run's epochs
  are as long as anyone else's (sink mode needs that). Its iterators (``create_tuple_iterator``,
  ``create_dict_iterator``) count steps: when the script asks for the next batch the previous step
  is done (heartbeat, checkpoint every ``checkpoint_interval_steps``, a planned stop), and they
  end at ``total_steps``.
- **track(\\*objects)** names what makes up the training state (the optimizer: the weights it
  updates, its moments, its step and learning rate; the network too for parameters the optimizer
  does not hold, such as batch-norm statistics), loads the agreed checkpoint into it (and
  MindSpore's random state: after the network is built) and saves it from then on. Checkpoints
  are MindSpore's own files (``mindspore.load_checkpoint`` reads them); a save copies the values
  and writes them in a background thread, so training waits only for the copy.
- **Callback()** does ``track`` for ``Model.train`` (its train network holds the weights and the
  optimizer) at ``on_train_begin``, and the step accounting at each step end (each sink's, in
  data sink mode), stopping with ``run_context.request_stop()`` at ``total_steps``.

Anything long that is not a step (an evaluation pass every N steps, a save of the script's own)
goes in a named section, so that elasticd's hang detection, which learns how long the job's steps
take, judges it by what that section took before, not by the steps' shorter limit::

    with elastic.section("eval"):
        accuracy = model.eval(test_set)

Without elasticd (plain msrun, a single process) nothing changes unless
``MSELASTIC_CHECKPOINT_DIR`` is set: the dataset is left as the script built it and no checkpoint
is written (one line says so). Jobs whose ``micro_batch_sizes`` need gradient accumulation cannot
be run by an unchanged loop: they are refused with that reason (the lower-level API,
:class:`ElasticData` with ``ctx.accumulation_steps``, handles them).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import sys
import threading
from typing import Any, Iterator

import numpy as np

from mselastic.core import contract
from mselastic.trainer.checkpoint import Checkpointer, Resumed
from mselastic.trainer.tensors import host_copy, rng_state
from mselastic.trainer.context import ElasticContext, joining
from mselastic.trainer.data import permutation, step_share

log = logging.getLogger("mselastic.trainer")

__all__ = ["Callback", "batches", "data", "finished", "session", "step", "track"]


def _hook_init() -> None:
    """Route ``mindspore.communication.init`` through :func:`joining` (once)."""
    import mindspore.communication as comm
    import mindspore.communication.management as management

    if getattr(comm.init, "__mselastic_joining__", False):
        return
    joined = joining(management.init)
    comm.init = joined
    management.init = joined


_hook_init()


def _under_elasticd() -> bool:
    return bool(os.environ.get(contract.ENV_CHECKPOINT_DIR))


class _Stream:
    """This rank's share of the job's sample stream, one MindSpore epoch (``steps_per_epoch`` steps)
    per pass, from step ``start``. MindSpore copies a sampler into every pipeline it builds (each
    ``create_*_iterator``) and asks the copy for one pass per epoch (and one ahead): so the state is
    plain values, and ``start`` is set to the steps done when an iterator is made."""

    def __init__(self, ctx: ElasticContext, seed: int, num_samples: int, start: int) -> None:
        self.rank, self.world, self.generation = ctx.rank, ctx.world_size, ctx.generation
        self.global_batch, self.seed, self.num_samples, self.start = ctx.global_batch_size, seed, num_samples, start
        self.passes = 0
        self.record = os.environ.get("MSELASTIC_RECORD_SAMPLES", "")

    def indices(self) -> Iterator[int]:
        g, spe = self.global_batch, self.num_samples // self.global_batch
        first = self.start + self.passes * spe
        self.passes += 1
        record = self._recorder()
        order: tuple[int, np.ndarray] | None = None
        for k in range(first, first + spe):
            epoch, offset = divmod(k, spe)
            if order is None or order[0] != epoch:
                order = (epoch, permutation(self.seed, epoch, self.num_samples))
            share = step_share(order[1], offset, g, self.rank, self.world)
            if record is not None:
                record.write(json.dumps({"step": k + 1, "rank": self.rank, "world": self.world,
                                         "generation": self.generation, "ids": share}) + "\n")
            yield from share
        if record is not None:
            record.close()

    def _recorder(self) -> Any:
        """With ``MSELASTIC_RECORD_SAMPLES`` set (a folder): where this rank's sampler writes the
        sample indices it hands out for each step (JSON lines, ``samples_g<G>_r<R>.jsonl``), to check
        afterwards that every sample of an epoch was used once. Off by default."""
        if not self.record:
            return None
        os.makedirs(self.record, exist_ok=True)
        return open(os.path.join(self.record, f"samples_g{self.generation}_r{self.rank}.jsonl"), "a")


def _sampler(stream: _Stream) -> Any:
    """``stream`` as a ``mindspore.dataset.Sampler`` (MindSpore is imported only when used)."""
    import mindspore.dataset as ds

    class StreamSampler(ds.Sampler):
        def __init__(self) -> None:
            self.stream = stream
            per_rank = (stream.num_samples // stream.global_batch) * (stream.global_batch // stream.world)
            super().__init__(num_samples=per_rank)

        def __iter__(self) -> Iterator[int]:
            return self.stream.indices()

    return StreamSampler()


class Session:
    """The elastic state of this process: one per process (:func:`session`)."""

    def __init__(self) -> None:
        self.ctx: ElasticContext | None = None
        self.ckpt: Checkpointer | None = None
        self.resumed: Resumed | None = None
        self.agreed = False
        #: Step the run resumed at; the number of steps done (both in the job's count).
        self.start_step = 0
        self.step = 0
        self.saved_step = 0
        self.seed = 0
        self.num_samples = 0
        self.loss = 0.0
        self.tracked: list[Any] = []
        #: Model.train drives the steps (its callback), not the dataset's iterators.
        self.callback = False
        #: The last pass over the data ran to its end and no iterator was made since.
        self.pass_ended = False
        #: The sampler of the taken-over dataset's source (its stream starts where an iterator is made).
        self.sampler: Any = None
        self._saving: threading.Thread | None = None
        self._save_error: BaseException | None = None
        self._done = False
        self.passthrough = False

    # -- set-up ---------------------------------------------------------------

    def context(self) -> ElasticContext:
        if self.ctx is None:
            try:
                from mindspore.communication import get_group_size
                get_group_size()
            except RuntimeError:
                raise SystemExit("mselastic: elastic.data() and elastic.track() come after "
                                 "mindspore.communication.init()") from None
            self.ctx = ElasticContext.current()
        return self.ctx

    def agree(self) -> None:
        """Agree on the resume point (every rank, once)."""
        if self.agreed:
            return
        ctx = self.context()
        self.ckpt = Checkpointer.from_context(ctx)
        self.resumed = self.ckpt.load(restore_rng=False)  # (by track(), after the network is built)
        self.agreed = True
        self.start_step = self.step = self.saved_step = self.resumed.manifest.step if self.resumed else 0
        if self.resumed is not None:
            log.warning("rank %d: resuming at step %d from %s", ctx.rank, self.start_step, self.resumed.manifest.file)

    def check_stream(self) -> None:
        """The checkpoint resumed from was taken on the same sample stream (seed, data set size)."""
        if self.resumed is None:
            return
        m = self.resumed.manifest
        if m.seed != self.seed or m.extra.get("num_samples", self.num_samples) != self.num_samples:
            raise SystemExit(f"mselastic: checkpoint {m.file} was taken with seed {m.seed} and "
                             f"{m.extra.get('num_samples')} samples, this run has seed {self.seed} and "
                             f"{self.num_samples}: was the job changed?")

    # -- step accounting ------------------------------------------------------

    def completed(self, step: int, loss: float | None = None) -> bool:
        """The steps up to ``step`` are done (all ranks at the same boundaries): heartbeat, a
        checkpoint when one is due, a planned stop (this rank leaves, after its checkpoint). True
        once ``total_steps`` is reached."""
        ctx = self.context()
        previous, self.step = self.step, step
        if loss is not None:
            self.loss = loss
        self._check_saved()
        ctx.beat(contract.BeatKind.STEP, step, self.loss)
        interval = ctx.checkpoint_interval_steps
        total = ctx.total_steps
        stop = ctx.should_stop(step, previous)
        at_end = bool(total) and step >= total
        if stop or at_end or step // interval > previous // interval:
            self.save(step)
        elif self.tracked and self.ckpt is not None:
            epoch, cursor = self._position(step)
            self.ckpt.snapshot(self.tracked, step, epoch, cursor, self.seed, extra={"num_samples": self.num_samples})
        if stop:
            self.wait_saved()
            ctx.planned_exit(step)
        if at_end:
            self.finish()
        return at_end

    def save(self, step: int) -> None:
        """A checkpoint of the tracked objects at ``step``: the values copied now, written in the
        background (at most one write at a time: a save waits for the one before)."""
        self.saved_step = step
        if not self.tracked or self.ckpt is None or not self.ckpt.writer:
            return
        self.wait_saved()
        values, rng = host_copy(self.tracked), rng_state()
        epoch, cursor = self._position(step)
        ckpt = self.ckpt

        def write() -> None:
            try:
                ckpt.save(values, step, epoch, cursor, self.seed, extra={"num_samples": self.num_samples}, rng=rng)
            except BaseException as e:  # noqa: BLE001 - surfaced on the training thread
                self._save_error = e

        self._saving = threading.Thread(target=write, name=f"mselastic-save-{step}", daemon=True)
        self._saving.start()

    def _position(self, step: int) -> tuple[int, int]:
        """The data position after ``step``: the epoch, and the samples of it consumed."""
        if not self.num_samples:
            return 0, 0
        gbs = self.context().global_batch_size
        epoch, offset = divmod(step, max(1, self.num_samples // gbs))
        return epoch, offset * gbs

    def wait_saved(self) -> None:
        if self._saving is not None:
            self._saving.join()
            self._saving = None
        self._check_saved()

    def _check_saved(self) -> None:
        if self._save_error is not None:
            e, self._save_error = self._save_error, None
            if isinstance(e, SystemExit):
                raise e
            raise RuntimeError(f"mselastic: the checkpoint could not be written: {e}") from e

    def at_exit(self) -> None:
        """The script ends. When its loop ran out of epochs before ``total_steps`` (its last pass over
        the data went to the end and it asked for no other), the job ends there, said out loud,
        after a last checkpoint. Anything else (an exception, ``sys.exit`` in the middle of a pass)
        is not an end of training: nothing is saved and the agent is not told it finished."""
        if self._done or self.ctx is None or hasattr(sys, "last_value"):
            return
        if not self.pass_ended:
            log.warning("rank %d: the script exits at step %d, in the middle of a pass over the data and before "
                        "total_steps %d: elasticd takes it for a failure and relaunches; if training is done, call "
                        "elastic.finished() first", self.ctx.rank, self.step, self.ctx.total_steps)
            return
        self.ended()

    def ended(self) -> None:
        """Training ended before ``total_steps`` by the script's own measure (its epochs): said out
        loud, a last checkpoint, the agent told the job is done."""
        ctx = self.context()
        if ctx.total_steps and self.step < ctx.total_steps:
            log.warning("rank %d: the script's training loop ended at step %d, before the job's total_steps %d: "
                        "the job ends here (give the script more epochs, or the job fewer steps)", ctx.rank,
                        self.step, ctx.total_steps)
        if self.step > self.saved_step:
            self.save(self.step)
        self.finish()

    def finish(self) -> None:
        """The job's last step is done: the last checkpoint written, the agent told."""
        if self._done:
            return
        self._done = True
        self.wait_saved()
        self.context().finished(self.step, self.loss)


_SESSION = Session()


def session() -> Session:
    """This process's elastic state (for tests and tools)."""
    return _SESSION


def _nodes(dataset: Any) -> Iterator[Any]:
    yield dataset
    for child in getattr(dataset, "children", []) or []:
        yield from _nodes(child)


def data(dataset: Any, seed: int = 0) -> Any:
    """Take ``dataset`` over for this job (see the module's notes) and return it. ``seed`` draws
    the epochs' permutations (the same on every rank and in every generation)."""
    import mindspore.dataset as ds

    s = _SESSION
    if not _under_elasticd():
        log.warning("mselastic: not under elasticd (no %s): training as the script says, without checkpoints",
                    contract.ENV_CHECKPOINT_DIR)
        s.passthrough = True
        return dataset
    nodes = list(_nodes(dataset))
    sources = [n for n in nodes if isinstance(n, ds.MappableDataset)]
    batches = [n for n in nodes if isinstance(n, ds.BatchDataset)]
    if len(sources) != 1 or not nodes[-1] is sources[0]:
        raise SystemExit("mselastic: elastic.data() takes a pipeline with one mappable source (MnistDataset, "
                         "ImageFolderDataset, NumpySlicesDataset, ...): it shards the source itself")
    if len(batches) != 1:
        raise SystemExit("mselastic: elastic.data() takes a pipeline with one batch() (the per-rank batch is "
                         "set from the job's global_batch_size)")
    ctx = s.context()
    if ctx.accumulation_steps > 1:
        raise SystemExit(f"mselastic: this job's micro_batch_sizes need {ctx.accumulation_steps} micro-batches per "
                         f"step at world size {ctx.world_size}: a loop of your own cannot accumulate them unchanged; "
                         f"use ElasticData and ctx.accumulation_steps, or allow micro-batch "
                         f"{ctx.global_batch_size // ctx.world_size}")
    source, batch = sources[0], batches[0]
    sharded = source.num_shards not in (None, 1)
    # The whole data set, not the script's shard of it (its own sampler is replaced anyway).
    source.sampler = ds.SequentialSampler(num_samples=getattr(source, "num_samples", None) or None)
    source.dataset_size = None
    num_samples = source.get_dataset_size()
    if num_samples < ctx.global_batch_size:
        raise SystemExit(f"mselastic: global batch {ctx.global_batch_size} is larger than the {num_samples} samples "
                         f"of the data set")
    s.seed, s.num_samples = seed, num_samples
    s.agree()
    s.check_stream()
    if batch.batch_size != ctx.micro_batch or sharded:
        log.warning("rank %d: mselastic shards the data set itself and batches %d per rank (global_batch_size %d "
                    "over %d ranks); the script's num_shards, shard_id, shuffle and batch size %d are not used",
                    ctx.rank, ctx.micro_batch, ctx.global_batch_size, ctx.world_size, batch.batch_size)
    s.sampler = source.sampler = _sampler(_Stream(ctx, seed, num_samples, s.step))
    source.num_shards, source.shard_id, source.shuffle_flag = None, None, False
    batch.batch_size, batch.drop_remainder = ctx.micro_batch, True
    for node in nodes:
        node.dataset_size = None
    for name in ("create_tuple_iterator", "create_dict_iterator"):
        setattr(dataset, name, _counting(getattr(dataset, name)))
    return dataset


def _counting(create: Any) -> Any:
    """``create`` (an iterator factory of the taken-over dataset): its pipeline's stream starts at
    the steps done so far, and the job's steps are counted."""
    def wrapped(*args: Any, **kwargs: Any) -> Iterator[Any]:
        _SESSION.sampler.stream.start = _SESSION.step
        _SESSION.pass_ended = False
        return _Steps(create(*args, **kwargs))
    return wrapped


class _Steps:
    """One pass over the data: asking for a batch says the step before it is done."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.pending = False

    def __iter__(self) -> "_Steps":
        return self

    def __next__(self) -> Any:
        s = _SESSION
        if s.callback:  # Model.train's own iterator: its callback counts
            if s.agreed and s.ctx is not None and s.ctx.total_steps and s.step >= s.ctx.total_steps:
                # Resumed at the end (the last generation finished its steps, then a rank died before
                # it exited): no batch, or Model.train would take one step past total_steps.
                raise StopIteration
            return next(self.inner)
        if self.pending:
            self.pending = False
            if s.completed(s.step + 1):
                raise StopIteration
        total = s.context().total_steps
        if total and s.step >= total:
            s.finish()
            raise StopIteration
        try:
            batch = next(self.inner)
        except StopIteration:
            s.pass_ended = True
            raise
        s.pass_ended = False  # (an iterator of several epochs goes on after a pass ended)
        self.pending = True
        return batch


def track(*objects: Any) -> None:
    """Name what the checkpoints hold (an optimizer, a network: their parameters), load the agreed
    checkpoint into it, and save it from now on (see the module's notes)."""
    import mindspore as ms

    s = _SESSION
    if s.passthrough or not _under_elasticd():
        s.passthrough = True
        return
    if not objects or not all(hasattr(o, "get_parameters") for o in objects):
        raise SystemExit("mselastic: elastic.track() takes the optimizer and/or the network (MindSpore cells)")
    s.agree()
    if not s.tracked:
        atexit.register(s.at_exit)
    s.tracked = list(objects)
    note = ""
    if s.resumed is not None:
        for obj in objects:
            ms.load_param_into_net(obj, s.resumed.params)
        s.resumed.restore_rng()
        note = s.resumed.note
        s.resumed = Resumed(s.resumed.manifest, {}, s.resumed.skipped)  # (the values are in place: let them go)
    s.context().started(s.start_step, note)


def batches(dataset: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
    """Every batch this rank trains on, epoch after epoch, until the job's ``total_steps`` (one
    pass without elasticd): a loop of the script's own over ``elastic.batches(dataset)`` instead of
    its epochs. ``dataset`` is taken over (:func:`data`) unless it was already; ``args`` and
    ``kwargs`` go to ``create_tuple_iterator``. Call :func:`track` before, :func:`step` with each
    step's loss if the heartbeats should carry it."""
    s = _SESSION
    if not s.passthrough and s.sampler is None:
        dataset = data(dataset)
    if s.passthrough:
        yield from dataset.create_tuple_iterator(*args, **kwargs)
        return
    if not s.tracked:
        raise SystemExit("mselastic: call elastic.track(optimizer) before elastic.batches(): the checkpoints "
                         "must hold the training state")
    total = s.context().total_steps
    while not total or s.step < total:
        before = s.step
        yield from dataset.create_tuple_iterator(*args, **kwargs)
        if not total or s.step == before:
            return


def step(loss: Any = None) -> None:
    """Optional in a loop of the script's own: the loss of the step just done, for the heartbeats
    (``elasticctl watch``); the step itself is counted when the next batch is asked for."""
    if loss is not None:
        _SESSION.loss = float(loss.asnumpy()) if hasattr(loss, "asnumpy") else float(loss)


@contextlib.contextmanager
def section(name: str) -> Iterator[None]:
    """A part of the run that is not a training step (an evaluation pass, a save of the script's
    own), named for elasticd's hang detection, which learns how long each takes
    (:meth:`ElasticContext.section`)::

        with elastic.section("eval"):
            accuracy = model.eval(test_set)

    Outside elasticd, or before the session has a context: nothing."""
    s = _SESSION
    if s.passthrough or s.ctx is None:
        yield
        return
    with s.ctx.section(name):
        yield


def finished() -> None:
    """Tell elasticd the job's training is done, when the loop ended before ``total_steps`` said
    so (a loop of its own over a fixed number of epochs, without elasticd's ``total_steps``)."""
    if not _SESSION.passthrough and _SESSION.agreed:
        _SESSION.finish()


def _callback_base() -> type:
    from mindspore.train import Callback as MsCallback
    return MsCallback


class Callback(_callback_base()):  # type: ignore[misc]
    """For ``Model.train``: resume before the first step, then heartbeats, checkpoints and planned
    stops at each step end (each sink's in data sink mode), ``request_stop()`` at ``total_steps``.
    Pass the dataset through :func:`data` too."""

    def __init__(self) -> None:
        super().__init__()
        _SESSION.callback = True

    def on_train_begin(self, run_context: Any) -> None:
        if _SESSION.passthrough or not _under_elasticd():
            return
        if not _SESSION.tracked:
            track(run_context.original_args().train_network)

    def on_train_step_end(self, run_context: Any) -> None:
        s = _SESSION
        if s.passthrough:
            return
        cb = run_context.original_args()
        loss = _loss(cb.net_outputs)
        if s.completed(s.start_step + int(cb.cur_step_num), loss):
            run_context.request_stop()

    def on_train_end(self, run_context: Any) -> None:
        """Model.train returned normally (it does not call this when it raises): at ``total_steps``
        the job is done already, before it (the script's epochs ran out) it ends here."""
        s = _SESSION
        if not s.passthrough and s.agreed:
            s.ended()


def _loss(outputs: Any) -> float | None:
    value = outputs[0] if isinstance(outputs, (tuple, list)) and outputs else outputs
    try:
        loss = float(value.asnumpy()) if hasattr(value, "asnumpy") else float(value)
    except (TypeError, ValueError):
        return None
    return loss if math.isfinite(loss) else None

