"""A small data-parallel trainer for ckpt-srun's cluster tests of node losses.

It trains exactly as ``examples/train_tiny.py`` does (the same model, data, per-parameter
all-reduce and output lines, so a run is bitwise comparable with train_tiny's reference
run), and adds what those tests need to see from each process:

* ``PID pid=P node=N rank=R``: first line, so a test tells one process from its
  replacement (a survivor keeps its pid, a relaunched rank does not);
* a log of its own, ``<log-dir>/<key>.rank<R>.pid<P>.log``, with every line it prints and
  every event of its Checkpointer: a process that srun no longer hears (its srun was
  stopped while the node was partitioned) still leaves its story there;
* ``--last-gasp NODE``: the rank on ``NODE``, when a collective fails (a peer is gone)
  or SIGTERM comes, saves its state at the last completed step and waits for the commits
  (``close()``), as many training scripts do in their error or preemption handler. When
  the node was partitioned and fenced, this is what its rank tries once it runs again
  (SLURM's slurmstepd there sends it SIGTERM as soon as it runs, and SIGKILL ``KillWait``
  later), so the test can check that the fence holds: ``LAST_GASP step=S error=...``
  says what the Checkpointer let it do.

The script is copied next to ``train_tiny.py`` (``<site>/examples/``) and imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Dict, Optional, TextIO

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_tiny as tt  # noqa: E402  (the trainer this one extends)

_LOCK = threading.Lock()
_LOG: Optional[TextIO] = None


def emit(line: str) -> None:
    """One whole line to stdout and to this process's own log."""
    with _LOCK:
        for out in (sys.stdout, _LOG):
            if out is None:
                continue
            try:
                out.write(line + "\n")
                out.flush()
            except (OSError, ValueError):  # srun gone: stdout may be a broken pipe
                pass


def on_event(name: str, info: Dict[str, Any]) -> None:
    if name == "local_done":
        emit(f"COMMITTED step={info['step']}")
    elif name == "flush_done":
        emit(f"FLUSHED step={info['step']}")
    elif name.endswith("failed"):
        emit(f"EVENT {name} step={info.get('step')} error={info.get('error')}")


def main() -> int:
    global _LOG
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--key", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interval-steps", type=int, default=10)
    p.add_argument("--sleep-per-step", type=float, default=0.1)
    p.add_argument("--log-dir", required=True)
    p.add_argument("--digest-out")
    p.add_argument("--last-gasp", metavar="NODE")
    args = p.parse_args()
    import torch
    import torch.nn.functional as F

    import slurm_ckpt.torch as sct

    torch.set_num_threads(1)
    tt.deterministic()
    targs = tt.parse_args(["--key", args.key, "--steps", str(args.steps)])
    rank, world = tt.setup_distributed(targs)
    pid, node = os.getpid(), os.environ.get("SLURMD_NODENAME", socket.gethostname())
    _LOG = open(  # noqa: SIM115 (open for the whole life of the process)
        os.path.join(args.log_dir, f"{args.key}.rank{rank}.pid{pid}.log"), "a"
    )
    os.dup2(_LOG.fileno(), 2)  # a traceback lands in the process's own log too
    emit(f"PID pid={pid} node={node} rank={rank}")
    progress = os.path.join(args.log_dir, f".srun_worker-{args.key}-rank{rank}.progress")

    model, opt, sched = tt.build(targs)
    tt.random.seed(targs.seed + rank)
    tt.np.random.seed(targs.seed + rank)
    torch.manual_seed(targs.seed + 1000 + rank)
    sampler = tt.Sampler(tt.make_corpus(targs.seed), targs.batch, targs.seed, rank, world)
    tc = sct.TorchCheckpointer.from_env(
        args.key,
        model=model,
        optimizer=opt,
        scheduler=sched,
        interval_steps=args.interval_steps,
        on_event=on_event,
    )
    gasp = args.last_gasp is not None and args.last_gasp == node
    if gasp:
        signal.signal(signal.SIGTERM, _on_term)  # after the Checkpointer's own handlers
    step, tokens = 0, 0
    got = tc.restore()
    if got is None:
        emit("START fresh")
    else:
        step, tokens = got.step, got.tokens or 0
        sampler.seek(got.data_position or {"epoch": 0, "index": 0})
        reached = tt.read_reached(progress)
        lost = None if reached is None else max(0, reached - step)
        emit(f"RESUMED step={step} reached={reached} lost={lost} tier={got.tier} tokens={tokens}")
    model.train()
    while step < args.steps:
        try:
            x, y = sampler.next()
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if world > 1:
                tt.average_gradients(model, world)
            opt.step()
            sched.step()
            step += 1
            tokens += int(x.numel()) * world
            with contextlib.suppress(OSError):  # a replaced rank may race its successor
                tt.write_reached(progress, step)
            time.sleep(args.sleep_per_step)
            if tc.should_save(step=step, tokens=tokens):  # a collective too
                tc.save(step=step, tokens=tokens, data_position=sampler.position())
                emit(f"SAVED step={step}")
        except (RuntimeError, _Terminated) as exc:  # a peer is gone (gloo), or SIGTERM
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            emit(f"PEER_LOST step={step} error={first}")
            if not gasp:
                raise
            return _last_gasp(tc, step, tokens, sampler)
        if tc.preempted:
            tc.close()
            emit(f"PREEMPTED step={step}")
            return 0
    tc.close()
    digest = sct.state_digest(model)
    emit(f"DONE step={step} digest={digest}")
    if args.digest_out and rank == 0:
        with open(args.digest_out, "w") as fh:
            fh.write(digest + "\n")
    tt._finish_distributed(world)
    return 0


class _Terminated(Exception):
    """SIGTERM, raised in the main thread (only on the ``--last-gasp`` node)."""


def _on_term(_signum: int, _frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the save must not be cut short
    emit("SIGTERM")
    raise _Terminated("SIGTERM")


def _last_gasp(tc: Any, step: int, tokens: int, sampler: Any) -> int:
    """Save the last completed step and wait for its commits; say what happened."""
    try:
        tc.save(step=step, tokens=tokens, data_position=sampler.position())
        tc.close()
        err = tc.stats.last_error  # a refused commit is recorded, not raised by close()
        emit(f"LAST_GASP step={step} error={err or 'none'}")
    except Exception as exc:  # what the fence says, in one line
        emit(f"LAST_GASP step={step} error={type(exc).__name__}: {str(exc)[:300]}")
    os._exit(3)  # the process group is broken: do not wait for its teardown


if __name__ == "__main__":
    sys.exit(main())
