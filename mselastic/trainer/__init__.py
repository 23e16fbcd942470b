"""The trainer library, imported by the training script inside each MindSpore worker.

It imports none of the daemon, agent or store, and is the only part of
mselastic that imports MindSpore (lazily). A script adds a few lines::

    ctx = ElasticContext.init()                  # calls mindspore.communication.init() first
    ckpt = Checkpointer.from_context(ctx)
    resumed = ckpt.load()                        # newest valid checkpoint or None
    ...
    ctx.beat("step", step, loss)                 # every step
    if step % ctx.checkpoint_interval_steps == 0 or ctx.stop_requested:
        ckpt.save(optimizer, step, epoch)
        if ctx.stop_requested: ctx.planned_exit(step)
    ctx.finished(step, loss)
"""

from mselastic.trainer.checkpoint import Checkpointer, Manifest, Resumed
from mselastic.trainer.context import ElasticContext

__all__ = ["Checkpointer", "ElasticContext", "Manifest", "Resumed"]
