"""What a checkpoint is made of, as MindSpore has it: the parameters of cells and optimizers
(copied to host memory and back), the dtypes a snapshot records, and MindSpore's random state."""

from __future__ import annotations

import contextlib
import sys
from typing import Any


def parameters_of(objects: list[Any]) -> dict[str, Any]:
    """The parameters of ``objects`` (cells, optimizers) by name, as MindSpore names them, each once
    (an optimizer holds the network's weights too): what a checkpoint holds."""
    seen: dict[str, Any] = {}
    for obj in objects:
        for p in obj.get_parameters():
            seen.setdefault(p.name, p)
    return seen


def host_copy(objects: list[Any]) -> list[dict[str, Any]]:
    """The parameters of ``objects`` (cells, optimizers), copied to host memory (numpy arrays)."""
    return [{"name": name, "data": p.asnumpy().copy()} for name, p in parameters_of(objects).items()]


def as_tensors(values: Any) -> Any:
    """A :func:`host_copy` as ``mindspore.save_checkpoint`` takes it (made into Tensors by the
    thread that writes it, without a copy: ``Tensor(array)`` would copy it again, holding the GIL)."""
    import mindspore as ms

    if not isinstance(values, list):
        return values
    return [v if isinstance(v.get("data"), ms.Tensor) else dict(v, data=ms.Tensor.from_numpy(v["data"]))
            for v in values]


def numpy_dtype(name: str) -> Any:
    """The numpy dtype a snapshot recorded by name; MindSpore's own for those numpy lacks (bfloat16)."""
    import numpy as np

    try:
        return np.dtype(name)
    except TypeError:
        import mindspore as ms

        ms_type = getattr(ms, name, None)
        if not isinstance(ms_type, ms.dtype.Type):
            raise ValueError(f"unknown dtype {name!r} in a snapshot") from None
        return np.dtype(ms.dtype_to_nptype(ms_type))


def rng_state() -> dict[str, Any]:
    """MindSpore's random state in a process: the global seed, the per-operator seed counters
    (``mindspore.common.seed``; every random operator built after ``set_seed``, such as
    ``ops.dropout`` at each call, takes its seeds from them) and the default generator's state."""
    import mindspore as ms

    seeds = sys.modules["mindspore.common.seed"]
    state: dict[str, Any] = {"global_seed": ms.get_seed(),
                             "kernel_seed": [[k[0], k[1], v] for k, v in seeds._KERNEL_SEED.items()]}
    with contextlib.suppress(Exception):  # absent or unusable on some backends: the rest still counts
        state["generator"] = bytes(ms.get_rng_state().asnumpy().tobytes()).hex()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Undo :func:`rng_state` (after the network is built: building it consumes seeds)."""
    import mindspore as ms
    import numpy as np

    if not state:
        return
    seeds = sys.modules["mindspore.common.seed"]
    if state.get("global_seed") is not None:
        ms.set_seed(int(state["global_seed"]))  # (resets the counters, so they are restored after it)
    seeds._KERNEL_SEED.clear()
    seeds._KERNEL_SEED.update({(k, s): int(v) for k, s, v in state.get("kernel_seed", [])})
    if state.get("generator"):
        ms.set_rng_state(ms.Tensor(np.frombuffer(bytes.fromhex(state["generator"]), np.uint8)))
