"""This node's accelerators (issue #32): what the config lists, what the node has, and whether
they agree. Detection asks what the vendors' tools and the kernel show: ``nvidia-smi -L`` for
NVIDIA GPUs, ``/dev/davinci<N>`` for Ascend NPUs (see :mod:`mselastic.core.devices` for the ids'
use)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

from mselastic.core.devices import VISIBLE, davinci_ids, format_ids, nvidia_smi_ids, parse_ids

log = logging.getLogger(__name__)

#: How long ``nvidia-smi -L`` may take (a wedged driver must not hold elasticd's start).
DETECT_S = 10.0


def detect() -> tuple[str, tuple[int, ...], str]:
    """(kind, ids, how they were found) of this node's accelerators; ("", (), "") for none."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=DETECT_S)
            ids = nvidia_smi_ids(r.stdout) if r.returncode == 0 else ()
            if ids:
                return "gpu", ids, "nvidia-smi -L"
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("nvidia-smi -L: %s", e)
    try:
        ids = davinci_ids(os.listdir("/dev"))
    except OSError:
        ids = ()
    return ("ascend", ids, "/dev/davinci*") if ids else ("", (), "")


def inventory(devices: str, kind: str) -> tuple[str, tuple[int, ...]]:
    """The node's (kind, device ids) per the ``devices`` and ``device_kind`` settings: "" none;
    "auto" what is detected; a list ("0-7") trusted as given unless the node's tools show devices
    of that kind and the list names one they do not. ValueError, saying what to change, otherwise."""
    if not devices:
        return "", ()
    found_kind, found, how = detect()
    if devices == "auto":
        if not found:
            raise ValueError("auto, but none were detected (no GPU in nvidia-smi -L, no /dev/davinci*): "
                             "list them (devices = \"0-7\" with device_kind), or leave devices empty")
        if kind and kind != found_kind:
            raise ValueError(f"auto with device_kind = {kind}, but {how} shows {found_kind} devices {format_ids(found)}")
        return found_kind, found
    ids = parse_ids(devices)
    if found_kind == kind and not set(ids) <= set(found):
        raise ValueError(f"{devices}, but {how} shows {kind} devices {format_ids(found)} here: list those, or "
                         f"devices = auto")
    if found_kind != kind:
        log.info("devices %s (%s) as configured: none of that kind detected here", format_ids(ids), kind)
    return kind, ids


__all__ = ["VISIBLE", "detect", "inventory"]
