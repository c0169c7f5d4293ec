"""Checkpoint accounting: interval formulas, sizes, the seeds' 70B figures, the CLI."""

from __future__ import annotations

import json
import math
import sys

import pytest
from click.testing import CliRunner

from slurm_ckpt.cli.plan import plan as plan_cmd
from slurm_ckpt.core.planner import (
    EXTRA_STATE_BYTES,
    Plan,
    PlanInputError,
    auto_interval,
    checkpoint_size,
    daly_interval,
    expected_loss,
    flush_every,
    make_plan,
    overhead_fraction,
    parse_count,
    per_node_bytes,
    write_time,
    young_interval,
)
from slurm_ckpt.errors import CkptError

GB = 10**9
MIN = 60.0
HOUR = 3600.0

# --------------------------------------------------------------------------- Young / Daly


def test_young_hand_computed():
    # C = 300 s, M = 6 h: 2 * 300 * 21600 = 12_960_000 = 3600**2.
    assert young_interval(300, 6 * HOUR) == pytest.approx(3600.0, rel=1e-12)
    # C = 60 s, M = 24 h: sqrt(2 * 60 * 86400) = sqrt(10_368_000).
    assert young_interval(60, 24 * HOUR) == pytest.approx(3219.937887, rel=1e-9)


def test_daly_hand_computed():
    # C/(2M) = 300/43200 = 1/144, sqrt = 1/12:
    # 3600 * (1 + 1/36 + 1/1296) - 300 = 3600 + 100 + 2.777... - 300 = 30625/9.
    assert daly_interval(300, 6 * HOUR) == pytest.approx(30625 / 9, rel=1e-12)
    assert daly_interval(300, 6 * HOUR) == pytest.approx(3402.7778, abs=1e-3)
    # Daly sits below Young for small C/M (the -C term dominates the correction).
    assert daly_interval(300, 6 * HOUR) < young_interval(300, 6 * HOUR)


def test_daly_is_mtbi_when_cost_at_least_twice_mtbi():
    assert daly_interval(2 * 6 * HOUR, 6 * HOUR) == 6 * HOUR
    assert daly_interval(50_000, 6 * HOUR) == 6 * HOUR
    # Just below the threshold the series applies: sqrt(4M^2) * 13/9 - 2M = 8M/9.
    m = 6 * HOUR
    assert daly_interval(2 * m * (1 - 1e-12), m) == pytest.approx(8 * m / 9, rel=1e-6)


def test_auto_interval_caps_by_max_loss():
    assert auto_interval(300, 6 * HOUR) == pytest.approx(30625 / 9)
    assert auto_interval(300, 6 * HOUR, max_loss_s=30 * MIN) == 1800.0
    assert auto_interval(300, 6 * HOUR, max_loss_s=2 * HOUR) == pytest.approx(30625 / 9)


@pytest.mark.parametrize(
    "args",
    [
        (0, 21600),
        (-1, 21600),
        (300, 0),
        (float("nan"), 21600),
        (300, float("inf")),
        (300, 21600, 0),
    ],
)
def test_auto_interval_rejects_bad_input(args):
    with pytest.raises(PlanInputError) as ei:
        auto_interval(*args)
    assert isinstance(ei.value, CkptError)
    assert ei.value.exit_code == 2
    assert "\n" not in str(ei.value)


def test_overhead_loss_and_flush_every():
    assert overhead_fraction(300, 3600) == pytest.approx(1 / 12)
    # Seed (Clockwork): a checkpoint every 3 h loses 1.5 h on average per failure.
    assert expected_loss(3 * HOUR) == 1.5 * HOUR
    assert expected_loss(1800, restart_s=120) == 1020.0
    assert flush_every(100, 300) == 1
    assert flush_every(300, 300) == 1
    assert flush_every(600, 300) == 2
    assert flush_every(601, 300) == 3
    assert flush_every(1960.134, 1800) == 2
    assert write_time(300 * GB, 500e6) == 600.0


# --------------------------------------------------------------------------- sizes


def test_size_70b_bf16_adamw_mixed_precision():
    b = checkpoint_size(70e9)  # bf16, adamw, fp32 master by default
    assert b.weights == 140 * GB  # the seed's "权重 140GB"
    assert b.master_weights == 280 * GB
    assert b.optimizer == 560 * GB  # two fp32 moments
    assert b.extra == EXTRA_STATE_BYTES
    assert b.total == 980 * GB + EXTRA_STATE_BYTES
    # The seed's range for weights + optimizer state: "300GB-1TB".
    assert 300 * GB <= b.total <= 1000 * GB
    assert b.to_dict()["total"] == b.total


@pytest.mark.parametrize(
    "kw, per_param",
    [
        ({"precision": "fp32"}, 4 + 8),  # fp32 weights are the master copy
        ({"precision": "fp16", "optimizer": "adam"}, 2 + 4 + 8),
        ({"optimizer": "sgd"}, 2 + 4 + 4),
        ({"optimizer": "none"}, 2 + 4),
        ({"master_weights": False}, 2 + 8),
        ({"precision": "FP32", "master_weights": True, "optimizer": "SGD"}, 4 + 4 + 4),
    ],
)
def test_size_per_parameter(kw, per_param):
    assert checkpoint_size(1e9, extra_bytes=0, **kw).total == per_param * GB


def test_size_bad_choices():
    with pytest.raises(PlanInputError, match="bf16|fp16|fp32"):
        checkpoint_size(70e9, precision="fp8")
    with pytest.raises(PlanInputError, match="adam"):
        checkpoint_size(70e9, optimizer="lion")


def test_parse_count():
    assert parse_count("70e9") == 70e9
    assert parse_count("70B") == 70e9
    assert parse_count("1.5M") == 1.5e6
    assert parse_count(" 7.5k ") == 7500
    assert parse_count(175e9) == 175e9
    for bad in ("seventy", "70X", "-1", "0", True):
        with pytest.raises(PlanInputError):
            parse_count(bad)


def test_per_node_bytes_layouts():
    assert per_node_bytes(1000, 8, sharded=True) == 125
    assert per_node_bytes(1001, 8, sharded=True) == 126  # ceil: the busiest node
    assert per_node_bytes(1000, 8, sharded=False) == 1000  # one replica writes all
    with pytest.raises(PlanInputError):
        per_node_bytes(1000, 0)


# --------------------------------------------------------------------------- the seeds' 70B table


@pytest.mark.parametrize("size_gb", [300, 350, 400])
def test_seed_70b_table(size_gb):
    """| Checkpoint 300-400GB | local NVMe ~2-4 min (few GB/s) | PFS 10-15 min (500MB/s) |"""
    p = make_plan(
        size=f"{size_gb}GB", local_bw="2GB/s", pfs_bw="500MB/s", mtbi="6h", max_loss="30min"
    )
    assert p.checkpoint_bytes == size_gb * GB
    assert 2 * MIN <= p.local_write_s <= 4 * MIN
    assert 10 * MIN <= p.pfs_write_s <= 15 * MIN
    assert p.local_write_s == size_gb * GB / 2e9
    assert p.pfs_write_s == size_gb * GB / 500e6
    # Async copy keeps up with a 30 min interval at 500 MB/s: no skipping needed.
    assert p.pfs_keeps_up is True
    assert p.flush_every == 1
    assert p.interval_s == 1800.0
    assert p.interval_basis == "max_loss"


def test_seed_300gb_single_client_10_minutes_and_25_percent():
    """'300GB at 500MB/s takes 10 min; synchronous, every 30 min it stops 10 min: -25 %'."""
    p = make_plan(size="300GB", pfs_bw="500MB/s", mtbi="6h", max_loss="30min")
    assert p.local_write_s is None
    assert p.pfs_write_s == 600.0
    assert p.save_cost_s == 600.0
    assert p.save_cost_basis == "pfs_write"
    assert p.interval_s == 1800.0
    assert p.wall_overhead_fraction == pytest.approx(0.25)
    assert p.overhead_fraction == pytest.approx(1 / 3)
    assert p.pfs_keeps_up is True and p.flush_every == 1  # synchronous
    # No local tier: restore from the PFS, and there is no copy lag.
    assert p.expected_loss_s == pytest.approx(900 + 600)
    assert p.expected_loss_pfs_s == pytest.approx(900 + 600)


def test_70b_from_params_brief_example():
    """ckpt-slurm plan --params 70e9 --local-bw 3GB/s --pfs-bw 500MB/s --mtbi 6h --max-loss 30min"""
    p = make_plan(params=70e9, local_bw="3GB/s", pfs_bw="500MB/s", mtbi="6h", max_loss="30min")
    total = 980 * GB + EXTRA_STATE_BYTES
    assert p.checkpoint_bytes == total
    c = total / 3e9
    assert p.local_write_s == pytest.approx(c)  # ~326.7 s, 5.4 min
    assert p.pfs_write_s == pytest.approx(total / 500e6)  # ~1960 s, 32.7 min
    assert p.young_interval_s == pytest.approx(math.sqrt(2 * c * 21600))  # ~3757 s
    x = c / 43200
    daly = math.sqrt(2 * c * 21600) * (1 + math.sqrt(x) / 3 + x / 9) - c
    assert p.daly_interval_s == pytest.approx(daly)  # ~3542 s
    assert p.interval_s == 1800.0 and p.interval_basis == "max_loss"
    assert p.overhead_fraction == pytest.approx(c / 1800)  # ~18 %
    assert p.pfs_keeps_up is False
    assert p.flush_every == 2
    assert p.pfs_interval_s == 3600.0
    assert p.expected_loss_s == pytest.approx(900 + c)
    assert p.expected_loss_pfs_s == pytest.approx(2 * 1800 / 2 + p.pfs_write_s + p.pfs_write_s)
    assert any("flush_every=2" in w for w in p.warnings)


def test_sharded_vs_replicated_local_write():
    kw = dict(size="800GB", local_bw="2GB/s", pfs_bw="4GB/s", mtbi="12h", nodes=8)
    sharded = make_plan(sharded=True, **kw)
    replicated = make_plan(sharded=False, **kw)
    assert sharded.bytes_per_node == 100 * GB
    assert sharded.local_write_s == 50.0
    assert replicated.bytes_per_node == 800 * GB
    assert replicated.local_write_s == 400.0
    assert sharded.pfs_write_s == replicated.pfs_write_s == 200.0  # aggregate PFS
    assert sharded.interval_s < replicated.interval_s  # cheaper save -> save more often
    assert sharded.pfs_keeps_up is True


def test_interval_tokens_and_restart_cost():
    p = make_plan(
        size="300GB",
        local_bw="2GB/s",
        pfs_bw="500MB/s",
        mtbi="6h",
        max_loss="30min",
        tokens_per_s="27777.78",
        restart_cost="5min",
    )
    # The seed's example interval: 50 M tokens.
    assert p.interval_tokens == pytest.approx(50_000_000, rel=1e-6)
    assert p.expected_loss_s == 900 + 300
    assert p.restore_local_s == p.restore_pfs_s == 300.0
    assert p.expected_loss_pfs_s == 900 + 600 + 300
    assert make_plan(size="300GB", pfs_bw="500MB/s", mtbi="6h").interval_tokens is None


def test_uncapped_uses_daly_and_stall_is_the_cost():
    p = make_plan(size="300GB", local_bw="1GB/s", pfs_bw="500MB/s", mtbi="6h", stall="20s")
    assert p.save_cost_s == 20.0 and p.save_cost_basis == "stall"
    assert p.interval_basis == "daly"
    assert p.interval_s == pytest.approx(daly_interval(20, 21600))
    assert p.young_interval_s == pytest.approx(math.sqrt(2 * 20 * 21600))
    assert p.local_write_s == 300.0
    assert p.pfs_keeps_up is True  # 600 s copy within the ~15 min interval

    # A stall so short the interval falls below the background local write: warned.
    q = make_plan(
        size="300GB", local_bw="1GB/s", pfs_bw="500MB/s", mtbi="6h", stall="1s", max_loss="4min"
    )
    assert any("background local write" in w for w in q.warnings)
    assert q.flush_every == 3  # 600 s copy / 240 s interval


def test_make_plan_input_errors():
    ok = dict(pfs_bw="500MB/s", mtbi="6h")
    with pytest.raises(PlanInputError, match="--params"):
        make_plan(**ok)
    with pytest.raises(PlanInputError):
        make_plan(params=70e9, size="300GB", **ok)
    with pytest.raises(PlanInputError, match="--local-bw"):
        make_plan(params=70e9, local_bw="fast", **ok)
    with pytest.raises(PlanInputError, match="--mtbi"):
        make_plan(params=70e9, pfs_bw="500MB/s", mtbi="often")
    with pytest.raises(PlanInputError, match="--max-loss"):
        make_plan(params=70e9, max_loss="0", **ok)
    with pytest.raises(PlanInputError, match="--size"):
        make_plan(size="0GB", **ok)


def test_to_dict_is_json_with_required_keys():
    p = make_plan(params="70B", local_bw="3GB/s", pfs_bw="500MB/s", mtbi="6h")
    assert isinstance(p, Plan)
    d = json.loads(json.dumps(p.to_dict()))
    for key in (
        "checkpoint_bytes",
        "local_write_s",
        "pfs_write_s",
        "young_interval_s",
        "daly_interval_s",
        "interval_s",
        "interval_tokens",
        "expected_loss_s",
        "overhead_fraction",
        "pfs_keeps_up",
        "flush_every",
    ):
        assert key in d, key
    assert d["interval_tokens"] is None
    assert d["size_breakdown"]["weights"] == 140 * GB
    assert d["interval_s"] == d["daly_interval_s"]


# --------------------------------------------------------------------------- CLI


def _runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        return CliRunner()  # click >= 8.2 keeps stderr apart by default


BRIEF = [
    "--params",
    "70e9",
    "--local-bw",
    "3GB/s",
    "--pfs-bw",
    "500MB/s",
    "--mtbi",
    "6h",
    "--max-loss",
    "30min",
]


def test_cli_json():
    r = _runner().invoke(plan_cmd, [*BRIEF, "--tokens-per-s", "1e6", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["checkpoint_bytes"] == 980 * GB + EXTRA_STATE_BYTES
    assert d["interval_s"] == 1800.0
    assert d["interval_tokens"] == 1_800_000_000
    assert d["pfs_keeps_up"] is False
    assert d["flush_every"] == 2
    assert d["local_write_s"] == pytest.approx(326.689, abs=1e-3)


def test_cli_options_reach_the_plan():
    args = [
        "--size",
        "800GB",
        "--nodes",
        "8",
        "--replicated",
        "--local-bw",
        "2GB/s",
        "--pfs-bw",
        "4GB/s",
        "--mtbi",
        "12h",
        "--restart-cost",
        "10min",
        "--json",
    ]
    d = json.loads(_runner().invoke(plan_cmd, args).stdout)
    assert d["bytes_per_node"] == 800 * GB and d["local_write_s"] == 400.0
    assert d["restore_pfs_s"] == 600.0
    d = json.loads(
        _runner()
        .invoke(
            plan_cmd,
            ["--params", "1e9", "--precision", "fp32", "--optimizer", "sgd"]
            + ["--no-master-weights", "--pfs-bw", "1GB/s", "--mtbi", "1d", "--json"],
        )
        .stdout
    )
    assert d["checkpoint_bytes"] == 8 * GB + EXTRA_STATE_BYTES


def test_cli_table():
    r = _runner().invoke(plan_cmd, BRIEF)
    assert r.exit_code == 0, r.output
    # IEC sizes (980.07 GB = 912.8 GiB); durations rounded (326.7 s = 5m27s, not 5m26s).
    for text in ("checkpoint size", "912.8GiB", "5m27s", "32m40s", "flush_every", "18.1%"):
        assert text in r.stdout, text
    assert "flush_every=2" not in r.stdout
    assert r.stderr.strip().startswith("warning: the PFS copy (32m40s)")  # warnings: stderr
    assert "flush_every=2" in r.stderr


def test_cli_parsable_raw_numbers():
    r = _runner().invoke(plan_cmd, [*BRIEF, "--parsable"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0] == "field|value"
    fields = dict(line.split("|") for line in lines[1:])
    assert int(fields["checkpoint_bytes"]) == 980 * GB + EXTRA_STATE_BYTES
    assert float(fields["interval_s"]) == 1800.0
    assert float(fields["local_write_s"]) == pytest.approx(326.689, abs=1e-3)
    assert fields["interval_tokens"] == ""


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--params", "70e9", "--local-bw", "fast", "--pfs-bw", "500MB/s", "--mtbi", "6h"],
            "--local-bw",
        ),
        (["--params", "70e9", "--pfs-bw", "500MB/s"], "--mtbi"),
        (["--params", "70e9", "--mtbi", "6h"], "--pfs-bw"),
        (["--params", "lots", "--pfs-bw", "500MB/s", "--mtbi", "6h"], "--params"),
        (["--params", "7e9", "--size", "1GB", "--pfs-bw", "1GB/s", "--mtbi", "6h"], "--size"),
        (["--params", "7e9", "--nodes", "0", "--pfs-bw", "1GB/s", "--mtbi", "6h"], "--nodes"),
        (
            ["--params", "7e9", "--precision", "fp8", "--pfs-bw", "1GB/s", "--mtbi", "6h"],
            "--precision",
        ),
        (
            ["--params", "7e9", "--pfs-bw", "1GB/s", "--mtbi", "6h", "--max-loss", "soon"],
            "--max-loss",
        ),
    ],
)
def test_cli_bad_input_one_line_exit_2(args, needle):
    r = _runner().invoke(plan_cmd, args)
    assert r.exit_code == 2
    assert isinstance(r.exception, SystemExit)  # no traceback
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ckpt-slurm: error: ") and needle in lines[0]
    assert "Traceback" not in r.output


def test_cli_plot_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "plan.png"
    r = _runner().invoke(plan_cmd, [*BRIEF, "--plot", str(out)])
    assert r.exit_code == 2
    assert r.stderr.strip() == "ckpt-slurm: error: plot needs matplotlib: pip install matplotlib"
    assert not out.exists()


def test_cli_plot_with_matplotlib(tmp_path):
    import matplotlib  # noqa: F401  (a dev dependency: the plot test must run, not skip)

    out = tmp_path / "plan.png"
    r = _runner().invoke(plan_cmd, [*BRIEF, "--plot", str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["flush_every"] == 2
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
