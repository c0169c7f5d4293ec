"""State serialisation without pickle: round trips, layout, and loading untrusted files."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import numpy as np
import pytest
import torch  # noqa: E402  (a test dependency: installed by scripts/setup)

from slurm_ckpt.errors import VerifyError  # noqa: E402
from slurm_ckpt.job.staging import PIECE, StagingArea, write_direct  # noqa: E402
from slurm_ckpt.job.state import (  # noqa: E402
    GROUP_REST,
    GROUP_WEIGHTS,
    flatten,
    index_bytes,
    layout,
    leaf_bytes,
    parse_index,
    unflatten,
)
from slurm_ckpt.job.state_reader import read_state  # noqa: E402
from slurm_ckpt.tiers.posix import PosixTier  # noqa: E402

PREFIX = "rank-00000"


def same(a: Any, b: Any, path: str = "") -> None:
    """Exact equality: types, dtypes, shapes and every bit of every value."""
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)), (
        f"{path}: {type(a)} != {type(b)}"
    )
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert bytes(leaf_bytes(a)) == bytes(leaf_bytes(b)), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def full_state() -> Dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3, 5, generator=g)
    return {
        "model": {
            "embed.weight": torch.randn(7, 4, generator=g).to(torch.bfloat16),
            "layer/0.weight": torch.randn(4, 4, generator=g, dtype=torch.float16),
            "param": torch.nn.Parameter(torch.randn(3, generator=g)),
            "transposed": big.t(),  # non-contiguous
            "strided": torch.arange(20, dtype=torch.int64)[::3],
        },
        "optimizer": {
            "state": {
                0: {"exp_avg": torch.randn(7, 4, generator=g), "step": torch.tensor(12.0)},
                1: {"exp_avg_sq": torch.zeros(0, 4, dtype=torch.float64)},
            },
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0, 1]}],
        },
        "misc": {
            "bool_t": torch.tensor([True, False, True]),
            "u8": torch.arange(10, dtype=torch.uint8),
            "i32": torch.tensor([-1, 2**31 - 1], dtype=torch.int32),
            "c64": torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
            "f8": torch.tensor([0.5, 1.0]).to(torch.float8_e4m3fn),
            "scalar0d": torch.tensor(3, dtype=torch.int16),
            "np_f32": np.arange(12, dtype=np.float32).reshape(3, 4),
            "np_noncontig": np.arange(24, dtype=np.int64).reshape(4, 6)[:, ::2],
            "np_bool": np.array([True, False]),
            "np_big_endian": np.arange(3, dtype=">i4"),
            "np_scalar": np.float64(2.5),
            "np_0d": np.array(7, dtype=np.uint16),
            "rng": b"\x00\xffraw-bytes",
            "ba": bytearray(b"mutable"),
            "empty_bytes": b"",
        },
        "values": [None, True, False, 0, -(2**70), 1.5, float("inf"), "text", ("t", [1, (2,)])],
        "odd keys/with slash": {"ünïcode ✓": 1, "": 2, "a\nb": 3, 42: "int key"},
        "step": 1234,
        "nan": float("nan"),
    }


def write_state(
    tier: PosixTier, state: Any, step: int = 1, staged: bool = True, key: str = "run"
) -> None:
    """Write ``state`` the way the Checkpointer does (staged buffers, or direct)."""
    index, tensors = flatten(state)
    blobs = layout(index)
    with tier.writer("alice", key, step) as w:
        if staged:
            area = StagingArea(limit=2**34)
            assert area.ensure([b["nbytes"] for b in blobs], tensors)
            bufs = area.snapshot(index, tensors)
            items = {f"{PREFIX}/{n}": v for n, v in bufs.items()}
            items[f"{PREFIX}/index.json"] = index_bytes(index)
            w.write_buffers(items)
        else:
            write_direct(w, PREFIX, index, tensors)
        w.commit()


def read_back(
    tier: PosixTier, step: int = 1, groups: Optional[Sequence[str]] = None, key: str = "run"
) -> Any:
    m = tier.manifest("alice", key, step)
    with tier.reader("alice", key, step) as r:
        state, _ = read_state(r, m, PREFIX, groups=groups, where="test")
    return state


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "direct"])
def test_round_trip_every_leaf_type(tmp_path: Path, staged: bool) -> None:
    tier = PosixTier("local", str(tmp_path), chunk_size=4096)  # many chunks per blob
    state = full_state()
    write_state(tier, state, staged=staged)
    got = read_back(tier)
    expected = dict(state)
    expected["model"] = dict(state["model"], param=state["model"]["param"].detach())
    same(expected, got)
    # bf16 bit-exact, restored as a plain tensor of the right dtype
    w = got["model"]["embed.weight"]
    assert w.dtype == torch.bfloat16 and not w.requires_grad
    assert torch.equal(w.view(torch.int16), state["model"]["embed.weight"].view(torch.int16))
    assert isinstance(got["misc"]["np_scalar"], np.float64)
    assert isinstance(got["misc"]["ba"], bytearray) and isinstance(got["misc"]["rng"], bytes)
    assert isinstance(got["values"][-1], tuple) and isinstance(got["optimizer"]["state"], dict)
    assert 0 in got["optimizer"]["state"]


def test_staged_and_direct_writes_are_byte_identical(tmp_path: Path) -> None:
    tier = PosixTier("local", str(tmp_path))
    state = full_state()
    write_state(tier, state, step=1, staged=True)
    write_state(tier, state, step=2, staged=False)
    m1, m2 = tier.manifest("alice", "run", 1), tier.manifest("alice", "run", 2)
    assert [(f.path, f.hash) for f in m1.files] == [(f.path, f.hash) for f in m2.files]


def test_weights_have_their_own_blob_and_load_alone(tmp_path: Path) -> None:
    tier = PosixTier("local", str(tmp_path))
    state = full_state()
    write_state(tier, state)
    index, _ = flatten(state)
    blobs = layout(index)
    assert [b["group"] for b in blobs] == [GROUP_WEIGHTS, GROUP_REST]
    for e in index["tensors"]:
        assert (e["blob"] == blobs[0]["name"]) == e["name"].startswith("/model/")
    weights = read_back(tier, groups=[GROUP_WEIGHTS])
    assert list(weights) == ["model"]
    rest = read_back(tier, groups=[GROUP_REST])
    assert "model" not in rest and rest["step"] == 1234
    # The on-disk files: an index and the blobs, nothing else, no pickle anywhere.
    names = sorted(os.listdir(tmp_path / "alice/run/step-0000000001" / PREFIX))
    assert names == ["data-0000.bin", "data-0001.bin", "index.json"]
    doc = json.loads((tmp_path / "alice/run/step-0000000001" / PREFIX / "index.json").read_text())
    assert doc["format"] == "slurm_ckpt.state"


def test_big_tensor_is_copied_in_pieces_on_threads(tmp_path: Path) -> None:
    big = torch.arange(PIECE // 4 * 2 + 123, dtype=torch.float32)  # > 2 pieces
    state = {"model": {"w": big}, "opt": {"m": big.numpy() * 2}}
    tier = PosixTier("local", str(tmp_path), streams=4)
    write_state(tier, state)
    got = read_back(tier)
    assert torch.equal(got["model"]["w"], big)
    assert np.array_equal(got["opt"]["m"], big.numpy() * 2)


def test_unflatten_from_raw_buffers() -> None:
    state = full_state()
    index, tensors = flatten(state)
    layout(index)
    raw = [bytes(leaf_bytes(t.buffer)) for t in tensors]
    got = unflatten(json.loads(index_bytes(index)), raw)
    assert torch.equal(got["model"]["transposed"], state["model"]["transposed"])
    same(got["misc"], state["misc"])
    assert [t.name for t in tensors][:2] == ["/model/embed.weight", "/model/layer/0.weight"]
    assert tensors[0].dtype == "bfloat16" and tensors[0].shape == (7, 4)


@pytest.mark.parametrize(
    "bad",
    [
        {1.5: 1},
        {"x": {1, 2}},
        {"x": object()},
        {"x": np.array([object()], dtype=object)},
        {"x": np.array(["s"])},
        {(1, 2): 3},
    ],
    ids=["float-key", "set", "object", "object-array", "str-array", "tuple-key"],
)
def test_unsupported_values_are_refused_with_their_path(bad: Dict[Any, Any]) -> None:
    with pytest.raises(TypeError, match="state"):
        flatten(bad)


def test_sparse_and_meta_tensors_are_refused() -> None:
    with pytest.raises(TypeError, match="strided"):
        flatten({"s": torch.eye(3).to_sparse()})
    with pytest.raises(TypeError, match="meta"):
        flatten({"m": torch.empty(3, device="meta")})


# ---------------------------------------------------------------- untrusted index


def good_index() -> Dict[str, Any]:
    index, _ = flatten({"model": {"w": torch.ones(4)}, "opt": {"m": np.ones(2, np.float64)}})
    layout(index)
    return json.loads(index_bytes(index))


def sizes(index: Dict[str, Any]) -> Dict[str, int]:
    return {b["name"]: b["nbytes"] for b in index["blobs"]}


def test_good_index_parses() -> None:
    idx = good_index()
    assert parse_index(json.dumps(idx).encode(), sizes(idx))["tensors"][0]["dtype"] == "float32"


def _mut(fn: Any) -> Any:
    return fn


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["tensors"][0].update(dtype="object"),
        lambda d: d["tensors"][1].update(dtype="|O"),
        lambda d: d["tensors"][1].update(dtype="<U4"),
        lambda d: d["tensors"][0].update(kind="pickle"),
        lambda d: d["tensors"][0].update(offset=10**12),
        lambda d: d["tensors"][0].update(offset=-64),
        lambda d: d["tensors"][0].update(shape=[-4]),
        lambda d: d["tensors"][0].update(shape=[5]),
        lambda d: d["tensors"][0].update(nbytes=1),
        lambda d: d["tensors"][0].update(blob="../../etc/passwd"),
        lambda d: d["tensors"][1].update(blob=d["tensors"][0]["blob"]),
        lambda d: d["blobs"][0].update(name="../x.bin"),
        lambda d: d["blobs"][0].update(nbytes=d["blobs"][0]["nbytes"] + 1),
        lambda d: d["tree"]["dict"][0][1]["dict"][0][1].update(tensor=99),
        lambda d: d["tree"]["dict"][0].__setitem__(1, {"pickle": "cos\nsystem"}),
        lambda d: d.update(format="torch.save"),
        lambda d: d.update(version=99),
    ],
)
def test_malformed_index_is_refused(mutate: Any) -> None:
    idx = good_index()
    disk = sizes(idx)
    mutate(idx)
    with pytest.raises(VerifyError, match="malformed state index"):
        parse_index(json.dumps(idx).encode(), disk)


def test_overlapping_ranges_and_deep_nesting_are_refused() -> None:
    index, _ = flatten({"opt": {"a": np.ones(4), "b": np.ones(4)}})
    layout(index)
    idx = json.loads(index_bytes(index))
    idx["tensors"][1]["offset"] = idx["tensors"][0]["offset"] + 8
    idx["blobs"][0]["nbytes"] = max(idx["blobs"][0]["nbytes"], idx["tensors"][1]["offset"] + 32)
    with pytest.raises(VerifyError, match="overlapping"):
        parse_index(json.dumps(idx).encode(), sizes(idx))
    deep = '{"format":"slurm_ckpt.state","version":1,"blobs":[],"tensors":[],"tree":'
    deep += '{"list":[' * 5000 + "]}" * 5000 + "}"
    with pytest.raises(VerifyError):
        parse_index(deep.encode(), {})
    with pytest.raises(VerifyError, match="not JSON"):
        parse_index(b"\x80\x04\x95pickle", {})


def test_corrupt_or_truncated_blob_fails_verification_on_load(tmp_path: Path) -> None:
    tier = PosixTier("local", str(tmp_path), chunk_size=4096)
    write_state(tier, full_state(), step=1)
    write_state(tier, full_state(), step=2)
    blob = tmp_path / "alice/run/step-0000000001" / PREFIX / "data-0001.bin"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x40
    blob.write_bytes(bytes(data))
    with pytest.raises(VerifyError, match="content hash mismatch"):
        read_back(tier, 1)
    # The weights alone are fine, but a partial load still checks the rest by default.
    with pytest.raises(VerifyError):
        read_back(tier, 1, groups=[GROUP_WEIGHTS])
    blob2 = tmp_path / "alice/run/step-0000000002" / PREFIX / "data-0000.bin"
    os.truncate(blob2, blob2.stat().st_size - 1)
    with pytest.raises(VerifyError, match="size"):
        read_back(tier, 2)
