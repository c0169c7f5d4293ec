"""The DCP backend in one process (no process group): what needs no cluster of ranks.

* the global metadata is JSON, never a pickle, and a load unpickles nothing unsafely: a
  checkpoint whose non-tensor item is a pickle that would run code is refused with one
  line (and the previous step is used), the code never runs;
* the writer survives pickling (DCP's process mode sends it to its child);
* a thread-mode save goes through the ledger and the one flush engine: the part is
  verified on the PFS after ``close()``;
* bad input is one line.

The multi-rank FSDP2 cases are in tests/test_dcp_fsdp2.py.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp

from slurm_ckpt import Checkpointer
from slurm_ckpt.errors import CkptError
from slurm_ckpt.ledger.record import State


class Evil:
    """A non-tensor item whose pickle runs a command when loaded without weights_only."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def ckpt(mounts: Any, pfs: Path) -> Iterator[Checkpointer]:
    local = mounts.tmpfs("64m", "local")
    c = Checkpointer(local=local, warm=pfs, key="run", install_signals=False, end_time_fn=None)
    yield c
    c.close()


def _save(ckpt: Checkpointer, state: Any, step: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ..."
        dcp.save(state, storage_writer=ckpt.dcp_writer(step=step, tokens=step * 10), no_dist=True)


def _load(reader: Any, state: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=reader, no_dist=True)


def _state(seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 33, generator=g),
        "h": torch.randn(17, generator=g).to(torch.bfloat16),
        "i": torch.arange(5, dtype=torch.int64) * seed,
        "empty": torch.empty(0, 3),
        "extra": {"epoch": seed, "name": f"run-{seed}", "lrs": [0.1, 0.01]},
    }


def _blank() -> Any:
    return {
        "w": torch.zeros(64, 33),
        "h": torch.zeros(17, dtype=torch.bfloat16),
        "i": torch.zeros(5, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "extra": {"epoch": 0, "name": "", "lrs": [0.0, 0.0]},
    }


def test_save_load_round_trip_metadata_is_json_and_flushed(ckpt: Checkpointer) -> None:
    want = _state(3)
    _save(ckpt, want, 7)
    ckpt.wait()
    step_dir = Path(ckpt.local.root) / ckpt.user / "run.dcp.rank00000" / "step-0000000007"
    doc = json.loads((step_dir / "dcp.metadata.json").read_bytes())  # JSON, not a pickle
    assert doc["world_size"] == 1 and doc["format"] == "slurm_ckpt.dcp/1"
    assert not list(step_dir.rglob(".metadata"))
    reader = ckpt.dcp_reader()
    assert reader is not None and (reader.step, reader.tokens) == (7, 70)
    got = _blank()
    _load(reader, got)
    for k in ("w", "h", "i", "empty"):
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])
    assert got["extra"] == want["extra"]
    assert reader.read_from == {0: "local"}
    ckpt.close()
    # the one flush engine took the part to the PFS, verified; the ledger says so
    assert [i.step for i in ckpt.warm.steps(ckpt.user, "run.dcp.rank00000")] == [7]
    assert ckpt.warm.verify(ckpt.user, "run.dcp.rank00000", 7).ok
    rec = ckpt._dcp.books.records()[7]
    assert rec.tiers["local"] == State.COMMITTED and rec.tiers["pfs"] == State.VERIFIED
    # the operator's tools see the part as any checkpoint: list and verify
    cfg = Path(ckpt.local.root).parent / "dcp-cli.toml"
    cfg.write_text(
        f'[tiers.local]\nroot = "{ckpt.local.root}"\nrequire_mount = false\nmin_free = 0\n'
        f'[tiers.pfs]\nroot = "{ckpt.warm.root}"\n[ledger]\ndir = "{cfg.parent / "ledger"}"\n'
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    cli = [sys.executable, "-m", "slurm_ckpt.cli.main", "--config", str(cfg)]
    out = subprocess.run([*cli, "list"], env=env, capture_output=True, text=True, check=True)
    assert len([ln for ln in out.stdout.splitlines() if "run.dcp.rank00000" in ln]) == 2
    out = subprocess.run(
        [*cli, "verify", "run.dcp.rank00000"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.count(" OK ") == 2, out.stdout + out.stderr


def test_malicious_pickle_refused_with_one_line(
    ckpt: Checkpointer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "pwned"
    _save(ckpt, _state(1), 1)
    evil = _state(2)
    evil["extra"]["name"] = Evil(marker)
    _save(ckpt, evil, 2)
    ckpt.wait()
    with caplog.at_level(logging.ERROR, logger="slurm_ckpt"):
        reader = ckpt.dcp_reader()
    assert reader is not None and reader.step == 1  # the planted step is refused
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and "\n" not in refusals[0] and "weights_only" in refusals[0]
    got = _blank()
    _load(reader, got)
    assert torch.equal(got["w"], _state(1)["w"])
    assert not marker.exists()
    # with only the planted step there is nothing to load, and still nothing runs
    assert ckpt.dcp_reader(step=2) is None
    assert not marker.exists()


def test_writer_pickles_for_process_mode(ckpt: Checkpointer) -> None:
    w = ckpt.dcp_writer(step=3)
    back = pickle.loads(pickle.dumps(w))
    assert (back.user, back.key, back.step, back.token) == (w.user, w.key, 3, w.token)
    assert back.tier.root == ckpt.local.root


@pytest.mark.parametrize("step", [-1, True, "3", 1.5])
def test_bad_step_is_one_line(ckpt: Checkpointer, step: Any) -> None:
    with pytest.raises(CkptError, match="^dcp_writer\\(\\): step must be a whole number"):
        ckpt.dcp_writer(step=step)


@pytest.mark.parametrize(
    "bend",
    [
        {"pos": 10**9},  # past the end of the part's data file
        {"shape": [2**20, 2**20]},  # 2**40 elements in a part of a few kB
        {"nbytes": 0, "shape": [2**20, 2**20]},  # 2**40 elements from no bytes at all
        {"rank": 5},  # a part the step does not have
    ],
    ids=["offset", "shape", "empty-shape", "rank"],
)
def test_metadata_that_does_not_fit_its_part_is_skipped(
    ckpt: Checkpointer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    bend: Any,
) -> None:
    """Step 2's metadata is the writer's own (its hash verifies) but one item does not
    fit its part: the step is skipped like a corrupt one and step 1 loads, bitwise."""
    from slurm_ckpt.job import dcp_storage

    _save(ckpt, _state(1), 1)
    real = dcp_storage.encode

    def bent(metadata: Any, items: Any, parts: Any) -> bytes:
        doc = json.loads(real(metadata, items, parts))
        for it in doc["items"]:
            if it["fqn"] == "w":
                it.update(bend)
        return json.dumps(doc).encode()

    monkeypatch.setattr(dcp_storage, "encode", bent)
    _save(ckpt, _state(2), 2)
    monkeypatch.undo()
    ckpt.wait()
    assert ckpt.local.verify(ckpt.user, "run.dcp.rank00000", 2).ok  # it verifies
    with caplog.at_level(logging.ERROR, logger="slurm_ckpt"):
        reader = ckpt.dcp_reader()
    assert reader is not None and reader.step == 1
    assert any("does not fit" in r.getMessage() for r in caplog.records)
    got = _blank()
    _load(reader, got)
    assert torch.equal(got["w"], _state(1)["w"]) and got["extra"] == _state(1)["extra"]
