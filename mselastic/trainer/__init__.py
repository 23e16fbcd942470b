"""The trainer library, imported by the training script inside each MindSpore worker.

It imports none of the daemon, agent or store, and is the only part of
mselastic that imports MindSpore (lazily). Most scripts need three lines of
:mod:`mselastic.trainer.elastic` (``from mselastic.trainer import elastic``;
``elastic.data(dataset)``; ``elastic.track(optimizer)``, or ``elastic.Callback()``
for ``Model.train``). The pieces under it, for loops that manage the data
position and gradient accumulation themselves::

    ctx = ElasticContext.init()                  # calls mindspore.communication.init() first
    ckpt = Checkpointer.from_context(ctx)
    resumed = ckpt.load()                        # newest valid checkpoint or None
    data = ElasticData(ctx, num_samples, seed)   # exactly-once samples at any world size
    pos = data.start(resumed)                    # epoch, seed, global sample cursor
    dataset = ds.MnistDataset(..., sampler=data.sampler(pos)).batch(ctx.micro_batch)
    ...                                          # ctx.accumulation_steps micro-batches per step
    pos = data.advance(pos)
    ctx.beat("step", step, loss)                 # every step
    stop = ctx.should_stop(step)                 # a planned stop: all ranks stop at the same step
    if step % ctx.checkpoint_interval_steps == 0 or stop:
        ckpt.save(optimizer, step, pos.epoch, pos.cursor, pos.seed)
        if stop: ctx.planned_exit(step)
    else:                                        # a snapshot in the node's memory between them
        ckpt.snapshot(optimizer, step, pos.epoch, pos.cursor, pos.seed)
    ctx.finished(step, loss)

Anything long that is not a step (an evaluation pass, a save of the script's own) goes in
``with ctx.section("eval"):``: without a ``hang_timeout_s`` the agent learns how long each
section takes and judges a silence by it (mselastic.agent.generation.learned).
"""

from mselastic.trainer.checkpoint import Checkpointer, Manifest, Resumed
from mselastic.trainer.context import ElasticContext
from mselastic.trainer.data import ElasticData, Position

__all__ = ["Checkpointer", "ElasticContext", "ElasticData", "Manifest", "Position", "Resumed"]
