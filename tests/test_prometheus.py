"""The operator's screen on a real Prometheus (Debian's ``prometheus`` and
``prometheus-node-exporter``, installed by scripts/setup, listening on 127.0.0.1 only).

* node_exporter's textfile collector serves the textfile a real run writes: a
  Checkpointer saving and flushing (job metrics) and a real ``ckpt-slurm stager`` pass
  (hook metrics); Prometheus scrapes it every second and evaluates the shipped alerts;
* every query of the shipped Grafana dashboard returns data, and the flush throughput
  (``rate(slurm_ckpt_flushed_bytes_total[5m])``) is above 0;
* ``promtool check rules`` and ``promtool test rules`` pass on the shipped alerts
  (tests/prometheus/alerts-test.yml: one alert fires on its test series, others stay
  silent).

Every wait polls Prometheus' HTTP API for the condition it needs; nothing sleeps for a
fixed time.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

REPO = Path(__file__).resolve().parents[1]
ALERTS = REPO / "etc" / "prometheus" / "slurm-ckpt-alerts.yml"
DASHBOARD = REPO / "etc" / "grafana-slurm-ckpt.json"
PROMETHEUS = "/usr/bin/prometheus"
NODE_EXPORTER = "/usr/bin/prometheus-node-exporter"
PROMTOOL = "/usr/bin/promtool"


def _need_tools() -> None:
    missing = [p for p in (PROMETHEUS, NODE_EXPORTER, PROMTOOL) if not os.access(p, os.X_OK)]
    if missing:  # scripts/setup installs them: a missing one is a broken setup, not a skip
        pytest.fail(f"{', '.join(missing)} missing: run scripts/setup")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - 127.0.0.1 only
        return json.loads(r.read())


class Prom:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def query(self, expr: str) -> List[Dict[str, Any]]:
        q = urllib.parse.urlencode({"query": expr})
        doc = _get(f"{self.base}/api/v1/query?{q}")
        assert doc["status"] == "success", doc
        return doc["data"]["result"]

    def wait(self, expr: str, what: str, timeout: float = 120.0) -> List[Dict[str, Any]]:
        end = time.monotonic() + timeout
        while True:
            try:
                got = self.query(expr)
            except OSError:
                got = []
            if got:
                return got
            assert time.monotonic() < end, f"{what}: {expr} had no data in {timeout}s"
            time.sleep(0.5)


@pytest.fixture
def stack() -> Iterator[Dict[str, Any]]:
    """A site config whose textfile node_exporter serves, and Prometheus scraping it."""
    _need_tools()
    base = Path(tempfile.mkdtemp(prefix="ckpt-prom-", dir="/var/tmp"))
    procs: List[subprocess.Popen] = []
    try:
        for d in ("local", "pfs", "prom", "ledger", "tsdb"):
            (base / d).mkdir()
        cfg_file = base / "site.toml"
        cfg_file.write_text(
            f'[tiers.local]\nroot = "{base}/local"\nrequire_mount = false\n'
            f'[tiers.pfs]\nkind = "posix"\nroot = "{base}/pfs"\n'
            f'[ledger]\ndir = "{base}/ledger"\n'
            f'[metrics]\ntextfile_dir = "{base}/prom"\n'
        )
        ne_port, prom_port = _free_port(), _free_port()
        procs.append(
            subprocess.Popen(
                [
                    NODE_EXPORTER,
                    f"--web.listen-address=127.0.0.1:{ne_port}",
                    "--collector.disable-defaults",
                    "--collector.textfile",
                    f"--collector.textfile.directory={base}/prom",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        (base / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files:\n  - {ALERTS}\n"
            "scrape_configs:\n  - job_name: node\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{ne_port}']\n"
        )
        procs.append(
            subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={base}/prometheus.yml",
                    f"--storage.tsdb.path={base}/tsdb",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        yield {"base": base, "config": cfg_file, "prom": Prom(prom_port)}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(base, ignore_errors=True)


def _dashboard_queries() -> List[str]:
    doc = json.loads(DASHBOARD.read_text())
    return [
        t["expr"].replace("$node", ".*")
        for p in doc["panels"]
        for t in p.get("targets", [])
        if isinstance(t, dict) and "expr" in t
    ]


def test_every_dashboard_query_has_data_from_a_real_run(stack: Dict[str, Any]) -> None:
    import numpy as np

    from slurm_ckpt import Checkpointer
    from slurm_ckpt.core.config import load_config

    prom: Prom = stack["prom"]
    prom.wait('up{job="node"} == 1', "node_exporter scraped")
    cfg = load_config(stack["config"])
    ckpt = Checkpointer(config=cfg, key="run", interval_steps=1)
    try:
        flushed = []
        for step in range(1, 9):
            ckpt.save({"w": np.full(1 << 18, step, dtype=np.float32)}, step=step)
            ckpt.wait()
            # The next save only once Prometheus saw this one's bytes: a counter that
            # grows between scrapes, so its rate is above 0 however slow the machine.
            got = prom.wait(
                f"slurm_ckpt_flushed_bytes_total >= {step * 1_000_000}", f"step {step} scraped"
            )
            flushed.append(float(got[0]["value"][1]))
    finally:
        ckpt.close()
    assert flushed == sorted(flushed) and flushed[-1] > flushed[0], flushed
    stager = subprocess.run(
        [
            sys.executable,
            "-m",
            "slurm_ckpt.cli.main",
            "--config",
            str(stack["config"]),
            "stager",
            "--once",
            "--no-slurm",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stager.returncode == 0, stager.stderr + stager.stdout
    prom.wait('slurm_ckpt_hook_success{hook="stager"} == 1', "the stager pass scraped")

    rate = prom.wait("rate(slurm_ckpt_flushed_bytes_total[5m]) > 0", "flush throughput")
    assert float(rate[0]["value"][1]) > 0
    empty = [q for q in _dashboard_queries() if not prom.query(q)]
    assert not empty, f"dashboard queries without data: {empty}"
    rules = _get(f"{prom.base}/api/v1/rules")["data"]["groups"]
    loaded = {r["name"]: r["health"] for g in rules for r in g["rules"]}
    assert set(loaded) == {
        "SlurmCkptHookFailing",
        "SlurmCkptNodeDrainedTooLong",
        "SlurmCkptNewestCheckpointTooOld",
        "SlurmCkptWarmTierFilling",
    }, loaded
    assert set(loaded.values()) == {"ok"}, loaded
    # Everything was flushed and every hook succeeded: no alert is pending or firing.
    assert prom.query("ALERTS") == []


def test_promtool_checks_and_unit_tests_the_shipped_alerts() -> None:
    _need_tools()
    check = subprocess.run(
        [PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True
    )
    assert check.returncode == 0 and "SUCCESS: 4 rules found" in check.stdout, check
    unit = subprocess.run(
        [PROMTOOL, "test", "rules", "alerts-test.yml"],
        cwd=REPO / "tests" / "prometheus",
        capture_output=True,
        text=True,
    )
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr


def test_promtool_unit_test_fails_when_an_alert_does_not_fire(tmp_path: Path) -> None:
    """The unit test can fail: the same series against rules whose hook alert is gone."""
    _need_tools()
    rules = tmp_path / "rules.yml"
    text = ALERTS.read_text().replace("min by (node, hook) (slurm_ckpt_hook_success) == 0", "0 > 1")
    rules.write_text(text)
    test = (REPO / "tests" / "prometheus" / "alerts-test.yml").read_text()
    (tmp_path / "t.yml").write_text(
        test.replace("../../etc/prometheus/slurm-ckpt-alerts.yml", str(rules))
    )
    unit = subprocess.run(
        [PROMTOOL, "test", "rules", "t.yml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert unit.returncode != 0 and "SlurmCkptHookFailing" in unit.stdout + unit.stderr
