"""A node's snapshots of the training state, in memory between checkpoints: written whole on the
training thread (the parameters' raw bytes with a CRC32, then their manifest; the newest two of a
generation kept), and read back for adoption as a checkpoint (see
:mod:`mselastic.trainer.checkpoint` for when one is adopted and how it is published)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import zlib
from typing import Any, Callable, Iterator

from mselastic.trainer.layout import MANIFEST, Manifest, write_atomic
from mselastic.trainer.tensors import numpy_dtype

log = logging.getLogger("mselastic.trainer")

#: A snapshot is written (and its CRC computed) this many bytes at a time.
CHUNK = 1 << 20


def write(folder: str, name: str, params: dict[str, Any], manifest: Callable[[str, int, list[dict[str, Any]], int],
          Manifest], generation: int) -> None:
    """``params`` (name -> a Parameter, Tensor or numpy array) as raw bytes in ``folder``/``name``.snap,
    then the manifest that makes them a snapshot (``manifest(file, size, tensors, crc32)``, written
    last: a file without one is litter); then only ``generation``'s two newest are kept."""
    import numpy as np

    path = os.path.join(folder, name + ".snap")
    tensors, crc = [], 0
    try:
        with open(path, "wb") as f:
            for key, value in params.items():
                # (asnumpy: the one copy, from the device; on CPU a view of the parameter's memory)
                array = value if isinstance(value, np.ndarray) else value.asnumpy()
                if not array.flags.c_contiguous:
                    array = array.copy(order="C")  # (not np.ascontiguousarray: it makes a scalar 1-d)
                data = array.reshape(-1).view(np.uint8).data  # (bytes of any dtype, bfloat16's too)
                for at in range(0, len(data), CHUNK):  # (each piece still in the cache for its CRC)
                    f.write(data[at:at + CHUNK])
                    crc = zlib.crc32(data[at:at + CHUNK], crc)
                tensors.append({"name": key, "dtype": array.dtype.name, "shape": list(array.shape)})
            size = f.tell()
    except BaseException:
        with contextlib.suppress(OSError):  # (memory: a failed write must not stay, once per step)
            os.remove(path)
        raise
    write_atomic(os.path.join(folder, name + ".json"), manifest(name + ".snap", size, tensors, crc).to_json())
    # Kept: this generation's two newest. An older generation's can no longer be adopted (this
    # one owns the checkpoint folder), and what a killed writer left half-written is litter.
    mine = sorted(n[: -len(".json")] for n in os.listdir(folder)
                  if (found := MANIFEST.match(n)) and found.group(2) and int(found.group(2)) == generation)
    for entry in os.listdir(folder):
        if entry.split(".", 1)[0] not in mine[-2:]:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, entry))


def adoptable(folder: str, job: str, generation: int, lineage: str, owner_generation: int,
              newest_step: int) -> Iterator[Manifest]:
    """The snapshots in ``folder`` a new ``generation`` of ``job`` may adopt, newest first: newer
    than every checkpoint (``newest_step``), of the folder's ``lineage`` (not the same job name's
    in another folder, or from before etcd was wiped), and taken by the generation that owns the
    checkpoint folder (``owner_generation``) or a later one (a replaced one, cut off and training
    on, is not)."""
    for name in sorted((n for n in os.listdir(folder) if MANIFEST.match(n)), reverse=True):
        try:
            with open(os.path.join(folder, name)) as f:
                m = Manifest(**json.load(f))
        except (OSError, ValueError, TypeError) as e:
            log.warning("snapshot %s unreadable (%s)", name, e)
            continue
        if m.step <= newest_step:
            return  # (newest first: none further down is newer than the checkpoints)
        if m.job != job or m.generation >= generation or m.lineage != lineage or m.generation < owner_generation:
            continue  # another folder's history (the same job name elsewhere, an etcd since wiped), or fenced
        yield m


def tensors_of(folder: str, m: Manifest) -> list[dict[str, Any]]:
    """The snapshot ``m``'s parameters, as ``mindspore.save_checkpoint`` takes them, after checking
    its size, CRC32 and layout; raises ValueError (or OSError) when it is not whole."""
    import mindspore as ms
    import numpy as np

    with open(os.path.join(folder, m.file), "rb") as f:
        raw = bytearray(f.read())
    if len(raw) != m.size or zlib.crc32(raw) != m.crc32:
        raise ValueError(f"{m.file} is damaged ({len(raw)} bytes of {m.size}, or its CRC32 differs)")
    values, offset = [], 0
    for t in m.tensors:
        dtype, shape = numpy_dtype(t["dtype"]), tuple(t["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        array = np.frombuffer(raw, dtype, count, offset).reshape(shape)
        values.append({"name": t["name"], "data": ms.Tensor.from_numpy(array)})
        offset += count * dtype.itemsize
    if offset != len(raw):
        raise ValueError(f"{m.file}: its layout covers {offset} bytes of {len(raw)}")
    return values
