"""The DCP backend in one process (no process group): what needs no cluster of ranks.

* the global metadata is JSON, never a pickle, and a load unpickles nothing unsafely: a
  checkpoint whose non-tensor item is a pickle that would run code is an error of one
  line (never a quiet fallback to the previous step), the code never runs;
* non-tensor items are stored as data: PyTorch's own TestTrainState (an io.BytesIO),
  numpy arrays and the RNG states of numpy, Python and torch round-trip; an item no load
  would take fails the save at once, naming the item and the fix;
* the writer survives pickling (DCP's process mode sends it to its child);
* a thread-mode save goes through the ledger and the one flush engine: the part is
  verified on the PFS after ``close()``;
* bad input is one line.

The multi-rank FSDP2 cases are in tests/test_dcp_fsdp2.py.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import random
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from slurm_ckpt import Checkpointer
from slurm_ckpt.dcp.storage import SlurmDcpWriter
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
        f'[tiers.pfs]\nkind = "posix"\nroot = "{ckpt.warm.root}"\n'
        f'[ledger]\ndir = "{cfg.parent / "ledger"}"\n'
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    cli = [sys.executable, "-m", "slurm_ckpt.cli.main", "--config", str(cfg)]
    out = subprocess.run([*cli, "list"], env=env, capture_output=True, text=True, check=True)
    assert len([ln for ln in out.stdout.splitlines() if "run.dcp.rank00000" in ln]) == 2
    out = subprocess.run(
        [*cli, "verify", "run.dcp.rank00000"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.count(" OK ") == 2, out.stdout + out.stderr


@dataclass
class TestTrainState:
    """PyTorch's own train state of its DCP e2e tests (test/distributed/checkpoint/e2e/
    test_e2e_save_and_load.py, torch 2.x), as it stands there: the loss history travels
    as an ``io.BytesIO`` holding a ``torch.save``."""

    __test__ = False  # not a pytest class

    step: int = 0
    current_loss: float = -1
    losses: List[float] = field(default_factory=list)

    def state_dict(self) -> Dict[str, Any]:
        loss_bytes = io.BytesIO()
        torch.save(self.losses, loss_bytes)
        return {
            "step": torch.tensor(self.step, dtype=torch.int32),
            "current_loss": torch.tensor(self.current_loss, dtype=torch.float32),
            "losses": loss_bytes,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.step = state_dict["step"].item()
        self.current_loss = state_dict["current_loss"].item()
        state_dict["losses"].seek(0)
        self.losses = torch.load(state_dict["losses"])


def test_train_state_bytesio_and_rng_states_round_trip(ckpt: Checkpointer) -> None:
    """What users put next to their tensors comes back as it was, with no pickle: an
    io.BytesIO (PyTorch's TestTrainState), numpy arrays, the RNG states of numpy, Python
    and torch. (Before: saved fine, refused at load, the job started from scratch.)"""
    np.random.seed(11)
    random.seed(11)
    train = TestTrainState(step=9, current_loss=0.25, losses=[1.0, 0.5, 0.25])
    want = {
        "model": {"w": torch.randn(4, 3)},
        "train": train,
        "np_rng": np.random.get_state(),
        "py_rng": random.getstate(),
        "torch_rng": torch.get_rng_state(),
        "gen_state": np.random.default_rng(5).bit_generator.state,
        "table": np.arange(12, dtype=np.float32).reshape(3, 4),
        "misc": {"name": "x", "ratio": 0.1, "seen": (1, 2), "blob": b"\x00\x01"},
    }
    _save(ckpt, want, 4)
    ckpt.wait()
    reader = ckpt.dcp_reader()
    assert reader is not None and reader.step == 4
    back = TestTrainState()
    got: Dict[str, Any] = {
        "model": {"w": torch.zeros(4, 3)},
        "train": back,
        "np_rng": None,
        "py_rng": None,
        "torch_rng": torch.zeros_like(want["torch_rng"]),
        "gen_state": np.random.default_rng(0).bit_generator.state,  # same shape
        "table": None,
        "misc": {"name": "", "ratio": 0.0, "seen": None, "blob": None},
    }
    _load(reader, got)
    assert torch.equal(got["model"]["w"], want["model"]["w"])
    assert back == train
    name, keys, pos, has_gauss, gauss = got["np_rng"]
    assert name == "MT19937" and keys.dtype == np.uint32 and np.array_equal(keys, want["np_rng"][1])
    assert (pos, has_gauss, gauss) == tuple(want["np_rng"][2:])
    np.random.set_state(got["np_rng"])  # numpy takes it back
    random.setstate(got["py_rng"])  # so does Python
    assert got["py_rng"] == want["py_rng"]
    assert torch.equal(got["torch_rng"], want["torch_rng"])
    assert got["gen_state"] == want["gen_state"]
    assert got["table"].dtype == np.float32 and np.array_equal(got["table"], want["table"])
    assert got["misc"] == want["misc"]
    # stored as data: the part holds no pickle of any of them
    part = Path(ckpt.local.root) / ckpt.user / "run.dcp.rank00000" / "step-0000000004"
    doc = json.loads((part / "dcp.metadata.json").read_bytes())
    kinds = {it["fqn"]: it["kind"] for it in doc["items"]}
    assert kinds["train.losses"] == kinds["np_rng"] == kinds["py_rng"] == "value"


class Opaque:
    """A user's class: no load with weights_only=True takes it."""

    def __init__(self) -> None:
        self.n = 3


def test_an_item_no_load_would_take_is_refused_at_save(
    ckpt: Checkpointer, caplog: pytest.LogCaptureFixture
) -> None:
    _save(ckpt, _state(1), 1)
    bad = _state(2)
    bad["extra"]["name"] = Opaque()
    refused = pytest.raises(BaseException, match="extra.name")  # DCP's CheckpointException
    with caplog.at_level(logging.ERROR, logger="slurm_ckpt"), refused as got:
        _save(ckpt, bad, 2)
    assert "add_safe_globals" in str(got.value) and "Opaque" in str(got.value)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("slurm_ckpt")]
    assert len(lines) == 1 and "\n" not in lines[0] and "'extra.name'" in lines[0]
    ckpt.wait()
    reader = ckpt.dcp_reader()
    assert reader is not None and reader.step == 1  # nothing of step 2 was committed
    assert ckpt.dcp_reader(step=2) is None


def test_malicious_pickle_is_an_error_at_load_and_never_runs(
    ckpt: Checkpointer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose item is a pickle that would run code (planted, or written before
    values existed): the load fails with one line - not damage, so no quiet fallback to
    the older step - and the code never runs."""
    marker = tmp_path / "pwned"
    _save(ckpt, _state(1), 1)
    evil = _state(2)
    evil["extra"]["name"] = Evil(marker)
    with pytest.raises(BaseException, match="weights_only"):
        _save(ckpt, evil, 2)  # our writer refuses it at once ...
    assert not marker.exists()

    # ... so plant it as a writer that stored the planner's pickle as is would have
    def as_pickle(self: Any, planner: Any, item: Any) -> Any:
        return memoryview(planner.resolve_data(item).getbuffer()), "bytes"

    monkeypatch.setattr(SlurmDcpWriter, "_value", as_pickle)
    _save(ckpt, evil, 3)
    monkeypatch.undo()
    ckpt.wait()
    with pytest.raises(CkptError) as got:
        ckpt.dcp_reader()
    msg = str(got.value)
    assert "\n" not in msg and "dcp step 3" in msg and "weights_only" in msg
    assert "not damage" in msg and "dcp_reader(step=N)" in msg
    assert not marker.exists()
    reader = ckpt.dcp_reader(step=1)  # the older step, when asked for
    assert reader is not None
    got_state = _blank()
    _load(reader, got_state)
    assert torch.equal(got_state["w"], _state(1)["w"])
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
    from slurm_ckpt.dcp import storage as dcp_storage

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


def test_a_taken_over_writer_commits_no_dcp_part(tmp_path: Path) -> None:
    """The series' generation fences DCP saves too: once another writer took the key over
    (``takeover=True``), the old writer's dcp.save commits nothing (it raised through
    DCP) and the new writer's steps stand."""
    import torch.distributed.checkpoint as dcp

    from slurm_ckpt import Checkpointer

    old = Checkpointer(local=str(tmp_path / "l"), key="run")
    try:
        dcp.save({"w": torch.ones(4)}, storage_writer=old.dcp_writer(step=1), no_dist=True)
        new = Checkpointer(local=str(tmp_path / "l"), key="run", takeover=True)
        try:
            with pytest.raises(BaseException, match="taken over"):
                dcp.save(
                    {"w": torch.full((4,), 2.0)},
                    storage_writer=old.dcp_writer(step=2),
                    no_dist=True,
                )
            dcp.save(
                {"w": torch.full((4,), 3.0)}, storage_writer=new.dcp_writer(step=3), no_dist=True
            )
        finally:
            new.close()
    finally:
        old.close()
    steps = sorted(p.name for p in (tmp_path / "l").glob("*/run.dcp.rank00000/step-*"))
    assert steps == ["step-0000000001", "step-0000000003"], steps
