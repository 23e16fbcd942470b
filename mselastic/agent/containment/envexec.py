"""``python -m mselastic.agent.containment.envexec FD -- CMD ARGS...``: add the variables read from file
descriptor FD (a JSON object elasticd writes into a pipe), close it, exec CMD.

How a job's ``env`` reaches msrun without passing through a process that still runs as root
(the user switch happens in setpriv, before this runs): ``LD_PRELOAD`` or ``PYTHONPATH``, if an
admin allows a job to set them, then only ever act as the worker user. The pipe keeps secrets
out of command lines, which every user can read, and off the disk."""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        raise SystemExit("usage: python -m mselastic.agent.containment.envexec FD -- CMD [ARGS...]")
    fd, cmd = int(argv[0]), argv[2:]
    with os.fdopen(fd) as f:
        env = json.load(f)
    os.environ.update({str(k): str(v) for k, v in env.items()})
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
