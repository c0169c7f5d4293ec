"""The checkpoint writer and flush threads yield the CPU to training (job/background.py):
they run at a nice value BACKGROUND_NICE above the training thread's, while save()'s
own thread keeps its priority."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from slurm_ckpt import Checkpointer
from slurm_ckpt.job.background import BACKGROUND_NICE, yield_cpu


def nice_of(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_yield_cpu_lowers_only_the_calling_thread() -> None:
    mine = nice_of(threading.get_native_id())
    seen = {}

    def run() -> None:
        yield_cpu()
        seen["nice"] = nice_of(threading.get_native_id())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen["nice"] == min(19, mine + BACKGROUND_NICE)
    assert nice_of(threading.get_native_id()) == mine


def test_checkpointer_writer_and_flush_threads_run_niced(tmp_path: Path) -> None:
    (tmp_path / "local").mkdir()
    (tmp_path / "warm").mkdir()
    mine = nice_of(threading.get_native_id())
    ck = Checkpointer(
        local=tmp_path / "local", warm=tmp_path / "warm", key="bg", install_signals=False
    )
    try:
        ck.save({"w": np.arange(1000, dtype=np.float32)}, step=1)
        assert ck.wait(flush=True)  # both threads have run a job: their nice is set
        threads = [t for t in threading.enumerate() if t.name in ("ckpt-local-bg", "ckpt-flush-bg")]
        assert sorted(t.name for t in threads) == ["ckpt-flush-bg", "ckpt-local-bg"]
        for t in threads:
            assert t.native_id is not None
            assert nice_of(t.native_id) == min(19, mine + BACKGROUND_NICE), t.name
        assert nice_of(threading.get_native_id()) == mine
        assert ck.stats.committed == 1 and ck.stats.flushes == 1
    finally:
        ck.close()


def test_partner_copy_threads_run_niced(tmp_path: Path) -> None:
    from test_partner import node, save_all, states

    mine = nice_of(threading.get_native_id())
    a, b = node(tmp_path, "na", 0), node(tmp_path, "nb", 1)
    try:
        save_all([a, b], 1, states(1)[0])  # both links have sent and received a copy
        threads = [t for t in threading.enumerate() if t.name.startswith("ckpt-partner-")]
        names = {t.name.rsplit("-", 1)[0] for t in threads}
        assert {"ckpt-partner-send", "ckpt-partner-recv"} <= names
        ours = [t for t in threads if t.name.split("-")[2] in ("send", "recv")]
        ours = [t for t in ours if t.name.endswith(("run.rank00000", "run.rank00001"))]
        assert len(ours) == 4, [t.name for t in threads]
        for t in ours:
            assert t.native_id is not None
            assert nice_of(t.native_id) == min(19, mine + BACKGROUND_NICE), t.name
    finally:
        a.close()
        b.close()
