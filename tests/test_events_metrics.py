"""Event log (JSON lines, O_APPEND, rotation, summary) and the Prometheus textfile.

Real files throughout; concurrency is shown with real processes writing at once, and the
textfile is read back with prometheus_client's own parser.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

from slurm_ckpt.core.config import Config
from slurm_ckpt.ledger import Ledger, State
from slurm_ckpt.ledger import events as ev
from slurm_ckpt.ledger.events import EventLog, events_path, read_events, read_summary
from slurm_ckpt.ledger.metrics import METRICS, TEXTFILE_NAME, refresh_textfile

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    (tmp_path / "local").mkdir()
    (tmp_path / "pfs").mkdir()
    return Config.standalone(
        tmp_path / "local", tmp_path / "pfs", metrics={"textfile_dir": str(tmp_path / "prom")}
    )


@pytest.fixture(autouse=True)
def _no_global_log():
    yield
    ev.configure(None)


# --------------------------------------------------------------------------- events


def test_event_line_format(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "e.jsonl", "n1")
    assert log.emit(
        "flush", user="alice", key="run", step=7, flush_s=1.5, nbytes=10, bad=float("nan")
    )
    assert log.emit("failure", reason="flush_failed", error="disk\nfull", where=tmp_path)
    lines = (tmp_path / "e.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 3
    first, second = (json.loads(x) for x in lines[:2])
    assert first["type"] == "flush" and first["node"] == "n1" and first["pid"] == os.getpid()
    assert first["step"] == 7 and first["flush_s"] == 1.5 and first["bad"] is None
    assert isinstance(first["ts"], float)
    assert second["error"] == "disk\nfull" and second["where"] == str(tmp_path)


def test_event_validation(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "e.jsonl", "n1")
    with pytest.raises(ValueError):
        log.emit("Bad Type")
    with pytest.raises(TypeError):
        log.emit("save", ts=1.0)
    assert log.emit("save", user="a", key="k", note="x" * 200_000)  # cut to 4 KiB
    assert log.emit("save", user="a", key="k", blob=["x" * 5000] * 100)  # 400 KiB line
    long_str, huge = list(read_events(log.path))
    assert len(long_str["note"]) == 4096 and long_str["note"].endswith("...")
    assert huge["truncated"] > 64 * 1024 and "blob" not in huge and huge["user"] == "a"


def test_events_path_default_and_configured(tmp_path: Path, cfg: Config) -> None:
    assert events_path(cfg, "n1") == cfg.ledger.dir / "events.jsonl"
    cfg2 = Config.standalone(
        tmp_path / "local", tmp_path / "pfs", metrics={"events_dir": str(tmp_path / "ev")}
    )
    assert events_path(cfg2, "n7") == tmp_path / "ev" / "events-n7.jsonl"


def test_module_emit_needs_configure(tmp_path: Path, cfg: Config) -> None:
    assert ev.emit("save", user="a", key="k") is False  # not configured: a no-op
    log = ev.configure(cfg, "n1")
    assert log is not None and ev.current() is log
    assert ev.emit("save", user="a", key="k", stall_s=0.1)
    assert [e["type"] for e in read_events(cfg.ledger.dir / "events.jsonl")] == ["save"]


def test_emit_never_raises_on_io_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    log = EventLog(blocker / "e.jsonl", "n1")
    assert log.emit("save", user="a", key="k") is False
    assert log.emit("save", user="a", key="k") is False  # and again: still no exception


def _writer(path: str, wid: int, count: int, max_bytes: int) -> None:
    log = EventLog(path, "n1", max_bytes=max_bytes, backups=200)
    pad = "x" * (1000 + 37 * wid)  # lines of different lengths
    for i in range(count):
        log.emit("save", user=f"u{wid}", key="k", seq=i, pad=pad)


@pytest.mark.parametrize("max_bytes", [1 << 30, 64 * 1024])
def test_concurrent_writers_never_interleave(tmp_path: Path, max_bytes: int) -> None:
    """Processes appending at once (and rotating, with the small limit): every line is
    whole JSON, and every event is there exactly once."""
    path = tmp_path / "e.jsonl"
    writers, count = 4, 150
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_writer, args=(str(path), w, count, max_bytes)) for w in range(writers)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    files = sorted(tmp_path.glob("e.jsonl*"))
    raw_lines = [
        line
        for f in files
        if not f.name.endswith((".lock", ".summary.json"))
        for line in f.read_bytes().splitlines()
    ]
    assert all(json.loads(line)["type"] == "save" for line in raw_lines)  # none torn
    seen: Dict[str, List[int]] = {}
    for e in read_events(path):
        seen.setdefault(e["user"], []).append(e["seq"])
    assert {u: sorted(s) for u, s in seen.items()} == {
        f"u{w}": list(range(count)) for w in range(writers)
    }
    if max_bytes < 1 << 30:
        assert (tmp_path / "e.jsonl.2").exists()  # it did rotate
        for f in files:
            if re.fullmatch(r"e\.jsonl(\.\d+)?", f.name):
                # A file may exceed the limit by the lines of writers racing the rotation.
                assert f.stat().st_size <= max_bytes + writers * 2000
    assert read_summary(path)["counts"] == {"save": writers * count}


def test_rotation_keeps_backups(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "e.jsonl", "n1", max_bytes=1000, backups=2)
    for i in range(100):
        log.emit("save", user="a", key="k", i=i, pad="y" * 80)
    names = sorted(p.name for p in tmp_path.iterdir() if re.fullmatch(r"e\.jsonl(\.\d+)?", p.name))
    assert names == ["e.jsonl", "e.jsonl.1", "e.jsonl.2"]
    kept = [e["i"] for e in read_events(log.path)]
    assert kept == sorted(kept) and kept[-1] == 99 and len(kept) < 100  # oldest dropped
    assert read_summary(log.path)["counts"]["save"] == 100  # counters survive rotation


def test_listener_maps_checkpointer_callbacks(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "e.jsonl", "n1")
    on_event = ev.listener("alice", "run", job=42, log_=log)
    on_event("save_start", {"step": 1})  # ignored
    on_event("save_returned", {"step": 1, "stall_s": 0.2})
    on_event("local_done", {"step": 1, "local_s": 1.0})
    on_event("flush_done", {"step": 1, "flush_s": 2.0})
    on_event("flush_failed", {"step": 2, "error": "EIO"})
    got = [(e["type"], e.get("step"), e["user"], e["key"], e["job"]) for e in read_events(log.path)]
    assert got == [
        ("save", 1, "alice", "run", "42"),
        ("local_write", 1, "alice", "run", "42"),
        ("flush", 1, "alice", "run", "42"),
        ("failure", 2, "alice", "run", "42"),
    ]
    assert list(read_events(log.path))[-1]["reason"] == "flush_failed"


# --------------------------------------------------------------------------- metrics


def _parse(text: str) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _v(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"node": "n1", **labels}.items())))]


def test_textfile_parses_and_holds_the_right_values(tmp_path: Path, cfg: Config) -> None:
    clock = [1000.0]
    led = Ledger(cfg.ledger.dir, "n1", clock=lambda: clock[0])
    # alice/run: step 10 flushed (3 s, 1000 B), step 20 and 30 still owed to the PFS.
    led.record_local_commit(
        "alice", "run", 10, 1000, 0, "77", True, durations={"snapshot_s": 0.5, "local_s": 2.0}
    )
    clock[0] = 1010.0
    led.mark("alice", "run", 10, "pfs", State.VERIFIED, durations={"flush_s": 3.0})
    clock[0] = 1020.0
    led.record_local_commit(
        "alice", "run", 20, 2000, 1, "77", True, durations={"snapshot_s": 0.25, "local_s": 1.25}
    )
    led.record_local_commit("alice", "run", 30, 4000, 2, "77", True)
    led.mark("alice", "run", 30, "pfs", State.FLUSHING)
    # bob/x: never flushed, not selected: nothing owed, but at risk from step 0.
    led.record_local_commit("bob", "x", 5, 100, 0, "78", False)
    led.count_failure("flush_failed")
    led.count_failure("flush_failed")
    led.count_failure("local_write_failed")

    log = ev.configure(cfg, "n1", clock=lambda: 2000.0)
    assert log is not None
    ev.emit("save", user="alice", key="run", step=20, stall_s=0.3)  # newer than the ledger
    ev.emit("flush", user="alice", key="run", step=10, flush_s=3.0, nbytes=1000)
    ev.emit("hook", hook="epilog", seconds=4.5, ok=True)
    ev.emit("hook", hook="prolog", seconds=0.5, ok=False)

    path = refresh_textfile(led, cfg)
    assert path == tmp_path / "prom" / TEXTFILE_NAME
    assert sorted(p.name for p in path.parent.iterdir()) == [TEXTFILE_NAME]  # no temp left
    s = _parse(path.read_text())
    P = "slurm_ckpt_"
    assert _v(s, P + "flush_queue_bytes") == 6000
    assert _v(s, P + "flush_queue_checkpoints") == 2
    assert _v(s, P + "flushes_in_flight") == 1
    assert _v(s, P + "steps_at_risk", user="alice", key="run") == 20  # 30 - 10
    assert _v(s, P + "steps_at_risk", user="bob", key="x") == 5
    assert _v(s, P + "bytes_at_risk", user="alice", key="run") == 6000
    assert _v(s, P + "bytes_at_risk", user="bob", key="x") == 0
    assert _v(s, P + "save_stall_seconds", user="alice", key="run") == 0.3  # event wins
    assert _v(s, P + "local_write_seconds", user="alice", key="run") == 1.25  # newest record
    assert _v(s, P + "flush_seconds", user="alice", key="run") == 3.0
    assert _v(s, P + "flush_bytes", user="alice", key="run") == 1000
    assert _v(s, P + "failures_total", reason="flush_failed") == 2
    assert _v(s, P + "failures_total", reason="local_write_failed") == 1
    assert _v(s, P + "events_total", type="hook") == 2
    assert _v(s, P + "events_total", type="save") == 1
    assert _v(s, P + "flushed_bytes_total") == 1000
    assert _v(s, P + "warm_verified_step", user="alice", key="run") == 10
    assert _v(s, P + "warm_verified_timestamp_seconds", user="alice", key="run") == 1010.0
    assert _v(s, P + "save_interval_seconds", user="alice", key="run") == 0.0  # 20, 30: same time
    assert (P + "save_interval_seconds", (("key", "x"), ("node", "n1"), ("user", "bob"))) not in s
    assert _v(s, P + "drain_checkpoints") == 2  # alice's 20 and 30 keep the node drained
    assert _v(s, P + "hook_seconds", hook="epilog") == 4.5
    assert _v(s, P + "hook_success", hook="epilog") == 1
    assert _v(s, P + "hook_success", hook="prolog") == 0
    assert _v(s, P + "hook_last_run_timestamp_seconds", hook="prolog") == 2000.0
    types = {f.name: f.type for f in text_string_to_metric_families(path.read_text())}
    assert types[P + "failures"] == "counter" and types[P + "flush_queue_bytes"] == "gauge"

    # Refreshing after a change replaces the file whole.
    led.mark("alice", "run", 20, "pfs", State.VERIFIED)
    s = _parse(refresh_textfile(led, cfg).read_text())  # type: ignore[union-attr]
    assert _v(s, P + "flush_queue_checkpoints") == 1
    assert _v(s, P + "steps_at_risk", user="alice", key="run") == 10


def _suspect_total(led: Ledger, cfg: Config) -> float:
    return _v(_parse(refresh_textfile(led, cfg).read_text()), "slurm_ckpt_suspect_steps_total")  # type: ignore[union-attr]


def test_the_suspect_metric_counts_steps_not_ranks(tmp_path: Path, cfg: Config) -> None:
    """Every rank of a job emits the verdict of one step (its own series, KEY.rankNNNNN):
    the counter counts the step once; events_total still counts every event."""
    led = Ledger(cfg.ledger.dir, "n1")
    log = EventLog.from_config(cfg, "n1")
    assert _suspect_total(led, cfg) == 0  # exported at 0 before any
    for rank in (0, 1):
        log.emit("replicas_suspect", user="alice", key=f"run.rank{rank:05d}", step=6, ranks=[1])
    assert _suspect_total(led, cfg) == 1
    log.emit("replicas_suspect", user="alice", key="run.dcp.rank00001", step=6)  # a DCP part
    log.emit("replicas_suspect", user="alice", key="run", step=6)  # root's, from the manifest
    assert _suspect_total(led, cfg) == 1
    log.emit("replicas_suspect", user="alice", key="run.rank00000", step=7)  # another step
    log.emit("replicas_suspect", user="bob", key="run.rank00000", step=6)  # another user's
    log.emit("replicas_suspect", user="alice", key="other", step=6)  # another key
    assert _suspect_total(led, cfg) == 4
    s = _parse(refresh_textfile(led, cfg).read_text())  # type: ignore[union-attr]
    assert _v(s, "slurm_ckpt_events_total", type="replicas_suspect") == 7


def test_root_records_a_suspect_step_once_and_a_forger_stays_bounded(
    tmp_path: Path, cfg: Config
) -> None:
    """``emit_suspect_once`` (root's hooks, at every scan): one event per step, ever;
    a user forging thousands of steps and keys leaves a bounded summary, and does not
    push another user's steps out of it."""
    from slurm_ckpt.ledger import suspect_steps as ss

    led = Ledger(cfg.ledger.dir, "n1")
    log = EventLog.from_config(cfg, "n1")
    assert log.emit_suspect_once(user="alice", key="run.rank00003", step=6)
    for _ in range(3):  # epilog, stager, the next prolog: already counted
        assert not log.emit_suspect_once(user="alice", key="run.rank00002", step=6)
    assert _suspect_total(led, cfg) == 1
    assert [e["step"] for e in read_events(log.path)] == [6]
    # mallory floods one series, newest first (as root records a scan): the memory
    # keeps the newest STEPS_KEPT, and every older step reads as counted
    new = sum(log.emit_suspect_once(user="mallory", key="k", step=s) for s in range(2000, 0, -1))
    assert new == ss.STEPS_KEPT
    assert not any(log.emit_suspect_once(user="mallory", key="k", step=s) for s in range(1, 2001))
    # ... and many keys: at most SERIES_PER_USER of hers are remembered, alice's stays
    for k in range(3 * ss.SERIES_PER_USER):
        log.emit_suspect_once(user="mallory", key=f"k{k}", step=1)
    mem = read_summary(log.path)["suspect"]
    assert sum(1 for label in mem if label.startswith("mallory/")) == ss.SERIES_PER_USER
    assert all(len(e["steps"]) <= ss.STEPS_KEPT for e in mem.values())
    assert not log.emit_suspect_once(user="alice", key="run", step=6)
    assert len(json.dumps(read_summary(log.path))) < 64 * 1024


def test_no_textfile_dir_means_no_textfile(tmp_path: Path) -> None:
    (tmp_path / "l").mkdir()
    (tmp_path / "p").mkdir()
    cfg = Config.standalone(tmp_path / "l", tmp_path / "p")
    led = Ledger(cfg.ledger.dir, "n1")
    assert refresh_textfile(led, cfg) is None


def test_grafana_dashboard_uses_exported_metrics() -> None:
    doc = json.loads((REPO / "etc" / "grafana-slurm-ckpt.json").read_text())
    exprs = [
        t["expr"]
        for p in doc["panels"]
        for t in p.get("targets", [])
        if isinstance(t, dict) and "expr" in t
    ]
    assert len(exprs) >= 10
    used = {n for e in exprs for n in re.findall(r"slurm_ckpt_[a-z_]+", e)}
    exported = set()
    for name, (kind, _, _) in METRICS.items():
        exported.add(name + "_total" if kind == "counter" else name)
    assert used <= exported, used - exported
    assert exported <= used, exported - used  # every metric is on the dashboard
    assert all(p.get("title") for p in doc["panels"])
    # A stat panel means something only with thresholds of its own (Grafana's default
    # turns any value above 80 red and a failed hook's 0 green).
    for p in doc["panels"]:
        if p["type"] == "stat":
            steps = p["fieldConfig"]["defaults"]["thresholds"]["steps"]
            assert len(steps) >= 2 and steps[0]["value"] is None, p["title"]
            assert [s["value"] for s in steps[1:]] != [80], p["title"]
        assert "PFS" not in p["title"], p["title"]  # "warm tier": a PFS or an object store


def test_a_jobs_flush_event_carries_its_bytes_and_tier(tmp_path: Path) -> None:
    """The dashboard's throughput panel sums the flush events' bytes: a real Checkpointer's
    flush must say how many bytes it moved, and to which tier (it said neither, and
    ``flushed_bytes_total`` stayed 0). The Checkpointer's callbacks go through the same
    listener the job's event log uses."""
    import numpy as np

    from slurm_ckpt import Checkpointer

    log = EventLog(tmp_path / "e.jsonl", "n1")
    ckpt = Checkpointer(
        local=str(tmp_path / "nvme"),
        warm=str(tmp_path / "pfs"),
        key="run",
        interval_steps=1,
        on_event=ev.listener("alice", "run", log_=log),
    )
    try:
        ckpt.save({"w": np.arange(1 << 16, dtype=np.float32)}, step=1)
    finally:
        ckpt.close()
    flushes = [e for e in read_events(log.path) if e["type"] == "flush"]
    assert len(flushes) == 1, list(read_events(log.path))
    # The warm tier by its name: a directory here ("pfs"), "object" at a site without a PFS.
    assert flushes[0]["nbytes"] >= 4 << 16 and flushes[0]["tier"] == "pfs", flushes
    assert read_summary(log.path)["flushed_bytes"] == flushes[0]["nbytes"]
