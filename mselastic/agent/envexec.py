"""``python -m mselastic.agent.envexec ENVFILE -- CMD ARGS...``: add the variables in ENVFILE
(a JSON object, written by elasticd for this worker user alone), remove the file, exec CMD.

How a job's ``env`` reaches msrun without passing through a process that still runs as root
(the user switch happens in setpriv, before this runs): ``LD_PRELOAD`` or ``PYTHONPATH``, if an
admin allows a job to set them, then only ever act as the worker user. The file keeps secrets
out of command lines, which every user can read."""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: python -m mselastic.agent.envexec ENVFILE -- CMD [ARGS...]")
    path, cmd = argv[0], argv[2:]
    with open(path) as f:
        env = json.load(f)
    os.unlink(path)
    os.environ.update({str(k): str(v) for k, v in env.items()})
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
