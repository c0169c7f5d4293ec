"""A rank relaunched on a spare fetches its shard from its partner copy (issue 21 item
3), in one process: Checkpointers are "nodes" with local tiers of their own, a shared
PFS, real TCP on 127.0.0.1 (tests/test_partner.py's setup).

Node nb (rank 1) is lost with its disk; with ``flush_every`` high its newest steps are
on no PFS, only on na as partner copies. The step is "relaunched"
(``SLURM_CKPT_RELAUNCH=1``): rank 0 again on na, rank 1 on a fresh node nc. What must
hold:

1. rank 1 reads its newest step straight from na over the authenticated transport
   (ranged reads, every chunk hashed on arrival), both ranks restore that step bitwise
   (``tier == "partner"``), and nc's own verified copy follows in the background;
2. the holder gone too (na lost as well): nothing to fetch, both restore the newest step
   the PFS has, bitwise;
3. a corrupt or truncated partner copy of the newest step is refused and never
   committed; the ranks agree on the step before it, whose partner copy is sound;
4. a requester without the job's secret, or asking for a series that is no rank of this
   job, gets nothing.
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
from test_checkpointer import assert_state_equal
from test_partner import local_tier, node, rank_key, save_all, states

from slurm_ckpt import Checkpointer
from slurm_ckpt.job.partner_fetch import FETCH, RANGE
from slurm_ckpt.job.partner_wire import WireError, client_handshake
from slurm_ckpt.job.restore import Restored
from slurm_ckpt.tiers.posix import PosixTier


class ThreadAgree:
    """``agree`` for ranks that are threads of one process: a min-reduce on a barrier."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=120)
        self.values: Dict[int, int] = {}
        self.lock = threading.Lock()

    def fn(self, rank: int) -> Callable[[int], int]:
        def agree(value: int) -> int:
            with self.lock:
                self.values[rank] = value
            self.barrier.wait()
            out = min(self.values.values())
            self.barrier.wait()
            return out

        return agree


def restore_all(ranks: List[Checkpointer]) -> List[Restored]:
    """Every rank's restore() at once (collective, like under torch.distributed)."""
    out: List[Optional[Restored]] = [None] * len(ranks)
    errors: List[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = ranks[i].restore()
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert all(r is not None for r in out), out
    return out  # type: ignore[return-value]


def lose(c: Checkpointer, tmp: Path, name: str) -> None:
    """The node dies with its disk: its rank never closes (no final flush)."""
    c.partner.close(0)  # type: ignore[union-attr]
    c._pipeline.finish(0)
    c._lease.release()  # its process is gone: so is the series lease it held
    shutil.rmtree(tmp / name / "local")


def end(c: Checkpointer) -> None:
    """A surviving rank's step ends (the failed step is killed: no final flush; its
    process exits, and with it the lease on its series)."""
    c.partner.close(0)  # type: ignore[union-attr]
    c._pipeline.finish(0)
    c._lease.release()


@pytest.fixture
def lost_nb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Three steps saved by rank 0 on na and rank 1 on nb; the PFS has step 1 only; nb
    is lost. Then the relaunch starts: ``relaunch(a_node, b_node)`` gives the new ranks."""
    a, b = node(tmp_path, "na", 0), node(tmp_path, "nb", 1)
    st = states(3)
    for step in (1, 2, 3):
        save_all([a, b], step, st[step - 1])
    pfs = PosixTier("pfs", str(tmp_path / "pfs"))
    assert [i.step for i in pfs.steps("root", rank_key(1))] == [1]
    assert [i.step for i in local_tier(tmp_path, "na").steps("root", rank_key(1))] == [2, 3]
    lose(b, tmp_path, "nb")
    end(a)
    monkeypatch.setenv("SLURM_CKPT_RELAUNCH", "1")
    agree = ThreadAgree(2)
    made: List[Checkpointer] = []

    def relaunch(a_node: str, b_node: str) -> List[Checkpointer]:
        for rank, name in enumerate((a_node, b_node)):
            made.append(node(tmp_path, name, rank, agree=agree.fn(rank)))
        return made

    yield tmp_path, st, relaunch
    for c in made:
        c.close()


def test_rank_on_a_spare_reads_its_partner_copy_bitwise(lost_nb: Any) -> None:
    tmp, st, relaunch = lost_nb
    a, c = relaunch("na", "nc")
    got = restore_all([a, c])
    assert [(g.step, g.tier) for g in got] == [(3, "local"), (3, "partner")]
    for g in got:
        assert_state_equal(st[2], g.state)
    # The state came straight from na; the spare's own copy follows in the background.
    assert c.partner.wait_idle(60)  # type: ignore[union-attr]
    nc = local_tier(tmp, "nc")
    assert [i.step for i in nc.steps("root", rank_key(1))] == [3]
    assert nc.verify("root", rank_key(1), 3).ok
    assert nc.manifest_bytes("root", rank_key(1), 3) == local_tier(tmp, "na").manifest_bytes(
        "root", rank_key(1), 3
    )
    assert (a.partner.stats.served, c.partner.stats.fetched) == (1, 1)  # type: ignore[union-attr]
    rec = c.ledger.get("root", rank_key(1), 3) if c.ledger is not None else None
    assert rec is not None and rec.extra["fetched_from"] == "na" and rec.pending_flush


def test_weights_first_from_the_partner_then_the_rest(lost_nb: Any) -> None:
    """``restore(weights_only=True)`` on the spare: the weights come first from the
    holder, the rest is read from it in the background, both bitwise."""
    tmp, st, relaunch = lost_nb
    a, c = relaunch("na", "nc")
    out: List[Any] = [None, None]

    def run(i: int, ck: Checkpointer) -> None:
        w = ck.restore(weights_only=True)
        out[i] = (w, ck.restore_rest())

    threads = [threading.Thread(target=run, args=(i, ck)) for i, ck in enumerate((a, c))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    (wa, ra), (wc, rc) = out
    assert [(wa.step, wa.tier), (wc.step, wc.tier)] == [(3, "local"), (3, "partner")]
    assert wc.partial and not rc.rolled_back and rc.tier == "partner"
    assert_state_equal({"model": st[2]["model"]}, wc.state)
    assert_state_equal({k: v for k, v in st[2].items() if k != "model"}, rc.state)
    assert c.partner.wait_idle(60)  # type: ignore[union-attr]
    assert local_tier(tmp, "nc").verify("root", rank_key(1), 3).ok


def test_holder_gone_too_falls_back_to_the_warm_tier(lost_nb: Any) -> None:
    tmp, st, relaunch = lost_nb
    shutil.rmtree(tmp / "na" / "local")  # the partner node is lost as well
    c0, c1 = relaunch("nd", "nc")
    got = restore_all([c0, c1])
    warm = c1.warm.name  # type: ignore[union-attr]
    assert [(g.step, g.tier) for g in got] == [(1, warm), (1, warm)]
    for g in got:
        assert_state_equal(st[0], g.state)
    assert c1.partner.stats.fetched == 0  # type: ignore[union-attr]
    assert local_tier(tmp, "nc").keys("root") in ([], [rank_key(1)])
    assert not local_tier(tmp, "nc").steps("root", rank_key(1))


def held_blob(tmp: Path) -> Tuple[Path, int]:
    """The largest payload file of rank 1's step 3 on na (its partner copy), and its size."""
    na = local_tier(tmp, "na")
    big = max(na.manifest("root", rank_key(1), 3).files, key=lambda e: e.size)
    return Path(na.step_path("root", rank_key(1), 3)) / big.path, big.size


def damaged_step_3_restores_step_2(lost_nb: Any, caplog: pytest.LogCaptureFixture, why: str) -> Any:
    """Relaunch on na + nc after the holder's copy of step 3 was damaged: the spare's
    read of it fails verification (``why`` in the log), so rank 1's newest sound step
    is 2, whose partner copy is sound; both ranks agree on it and restore it bitwise
    (rank 0 from its local tier). Step 3 is never committed on nc; the spare's own copy
    of step 2 follows in the background. Returns the spare's Checkpointer."""
    tmp, st, relaunch = lost_nb
    a, c = relaunch("na", "nc")
    got = restore_all([a, c])
    assert [(g.step, g.tier) for g in got] == [(2, "local"), (2, "partner")]
    for g in got:
        assert_state_equal(st[1], g.state)
    assert any(why in r.getMessage() and "step-3" in r.getMessage() for r in caplog.records)
    assert c.partner.wait_idle(60)  # type: ignore[union-attr]
    assert [i.step for i in local_tier(tmp, "nc").steps("root", rank_key(1))] == [2]
    assert c.partner.stats.fetched == 1  # type: ignore[union-attr]
    # The holder's copy is its node's to deal with: nothing about it in the spare's books.
    assert c.ledger is None or c.ledger.get("root", rank_key(1), 3) is None
    assert (tmp / "na" / "local").exists() and held_blob(tmp)[0].exists()
    return c


def test_corrupt_partner_copy_is_refused_never_committed(
    lost_nb: Any, caplog: pytest.LogCaptureFixture
) -> None:
    path, size = held_blob(lost_nb[0])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    c = damaged_step_3_restores_step_2(lost_nb, caplog, "content hash mismatch")
    # A whole-step fetch of it (the spare's own copy) is refused too, chunk by chunk.
    assert c.partner.fetch(3) is None  # type: ignore[union-attr]
    stats = c.partner.stats  # type: ignore[union-attr]
    assert (stats.fetched, stats.fetch_failures) == (1, 1)
    assert "do not match the manifest" in (stats.last_error or "")
    assert [i.step for i in local_tier(lost_nb[0], "nc").steps("root", rank_key(1))] == [2]


def test_truncated_partner_copy_ends_the_send_and_commits_nothing(
    lost_nb: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The holder sends a file with ``sendfile``: a copy cut short under it (here: a
    payload file truncated on the holder's disk) stops the send at the short read
    instead of sending less than the manifest says; the spare's read fails, nothing of
    step 3 is committed on it, and the ranks restore step 2."""
    path, size = held_blob(lost_nb[0])
    with open(path, "r+b") as fh:
        fh.truncate(size // 2)
    c = damaged_step_3_restores_step_2(lost_nb, caplog, "the holder stopped sending")
    assert c.partner.fetch(3) is None  # type: ignore[union-attr]
    assert c.partner.stats.fetch_failures == 1  # type: ignore[union-attr]


def test_fetch_needs_the_secret_and_a_rank_series_of_this_job(lost_nb: Any) -> None:
    tmp, _st, relaunch = lost_nb
    a, c = relaunch("na", "nc")
    port = a.partner.port  # type: ignore[union-attr]
    ident = c.partner.ident  # type: ignore[union-attr]
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    with s, pytest.raises(WireError):
        # not the job's secret: hung up on
        client_handshake(s, dataclasses.replace(ident, secret=b"x" * 32), 0)
    assert a.partner.stats.refused == 1  # type: ignore[union-attr]
    for key in (f"other.rank{1:05d}", rank_key(0), "../x"):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            ch = client_handshake(s, ident, 0)
            ch.send_frame(FETCH + f'{{"op": "get", "key": "{key}", "step": 3}}'.encode())
            assert ch.recv_exact(1) == b"N"
    assert a.partner.stats.refused == 4  # type: ignore[union-attr]
    assert a.partner.stats.served == 0  # type: ignore[union-attr]


def test_holder_serves_only_ranges_inside_the_steps_files(lost_nb: Any) -> None:
    """A peer with the job's secret still gets only bytes of the manifest's files: a
    range past a file's end (or a file index past the manifest) ends the session."""
    tmp, _st, relaunch = lost_nb
    a, c = relaunch("na", "nc")
    port, ident = a.partner.port, c.partner.ident  # type: ignore[union-attr]
    held = local_tier(tmp, "na").manifest("root", rank_key(1), 3)
    big = max(range(len(held.files)), key=lambda i: held.files[i].size)
    open_req = FETCH + f'{{"op": "open", "key": "{rank_key(1)}", "step": 3}}'.encode()
    for i, off, n in ((big, held.files[big].size - 10, 11), (len(held.files), 0, 1)):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            ch = client_handshake(s, ident, 0)
            ch.send_frame(open_req)
            assert ch.recv_exact(1) == b"G"
            assert ch.recv_frame() == local_tier(tmp, "na").manifest_bytes("root", rank_key(1), 3)
            ch.send_frame(RANGE.pack(big, 0, 16))  # a good range is served
            assert len(ch.recv_exact(16)) == 16
            ch.send_frame(RANGE.pack(i, off, n))
            assert s.recv(1) == b""  # hung up on, nothing sent
