"""`mogrpo train CONFIG --nproc N`: one machine, N processes, started by torchrun.

The command is run again under `python -m torch.distributed.run --standalone
--nproc-per-node N -m mogrpo.cli train ...` with every other argument passed through (and the
environment, so `MOGRPO_*` values reach each process); this process only waits for torchrun
and returns its exit status. Several machines are launched with torchrun directly (README:
"Scale out").
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import subprocess
import sys

from mogrpo.errors import ConfigError

log = logging.getLogger(__name__)

STOP_WAIT_S = 30
"""After Ctrl-C: how long torchrun gets to stop its workers before it is terminated."""


def check_nproc(nproc: int) -> None:
    """Refuse a process count torchrun cannot start, or `--nproc` inside a launched process."""
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: the number of processes must be at least 1 "
                          "(one per GPU)")
    world = os.environ.get("WORLD_SIZE")
    if world is not None:
        raise ConfigError(f"--nproc {nproc} given inside a process that torchrun (or another "
                          f"launcher) already started (WORLD_SIZE={world}); drop --nproc: the "
                          "launcher's --nproc-per-node and --nnodes set the process count")


def train_arguments(args: argparse.Namespace) -> list[str]:
    """This `mogrpo train` command's arguments without `--nproc`: what each process gets."""
    argv = [str(args.config)]
    for override in args.overrides:
        argv += ["--set", override]
    if args.resume is not None:
        argv += ["--resume", args.resume]
    if args.allow_config_change:
        argv.append("--allow-config-change")
    if args.strict:
        argv.append("--strict")
    return argv


def torchrun_command(args: argparse.Namespace, nproc: int) -> list[str]:
    """The torchrun command line that runs this `mogrpo train` in `nproc` processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "-m", "mogrpo.cli", "train", *train_arguments(args)]


def launch(args: argparse.Namespace, nproc: int) -> int:
    """Run torchrun for `nproc` processes and return its exit status (128 + N if signal N
    ended it). Ctrl-C reaches torchrun from the terminal too: it stops its workers, and this
    waits for that before it passes the interrupt on."""
    command = torchrun_command(args, nproc)
    log.info("launching %d processes: %s", nproc, shlex.join(command))
    process = subprocess.Popen(command)
    try:
        status = process.wait()
    except KeyboardInterrupt:
        try:
            process.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            process.terminate()
            process.wait()
        raise
    return 128 - status if status < 0 else status
