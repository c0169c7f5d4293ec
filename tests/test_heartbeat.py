"""ckpt-srun's node heartbeats (slurm_ckpt/ops/heartbeat.py): the datagram, the verdict.

The verdict's arithmetic runs on an injected clock; the transport runs for real: agent
processes sending UDP on 127.0.0.1 to a monitor, one of them stopped with SIGSTOP (a node
that stops answering) while the other goes on. The whole path on a real node death (slurmd
and every process killed, nobody marking the node DOWN) is in
tests/test_cluster_spares.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from slurm_ckpt.ops.heartbeat import (
    HEARTBEAT_ENV,
    HeartbeatMonitor,
    decode_beat,
    encode_beat,
    parse_endpoint,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_beat_round_trips_and_anything_else_is_dropped() -> None:
    key = os.urandom(32)
    beat = encode_beat(key, b"r" * 8, 7, "gpu-001")
    assert decode_beat(key, beat) == (b"r" * 8, 7, "gpu-001")
    assert decode_beat(os.urandom(32), beat) is None  # another job's (or a forger's) key
    flipped = bytearray(beat)
    flipped[20] ^= 1
    assert decode_beat(key, bytes(flipped)) is None
    assert decode_beat(key, beat[:-1]) is None
    assert decode_beat(key, b"") is None
    assert decode_beat(key, b"x" * 4096) is None


def test_the_verdict_counts_silence_from_the_last_beat_and_startup_from_the_start() -> None:
    clock = Clock()
    mon = HeartbeatMonitor("127.0.0.1", ["n1", "n2", "n3"], 10.0, startup_s=30.0, clock=clock)
    try:
        key, run = mon.secret, b"a" * 8
        assert mon.receive(encode_beat(key, run, 1, "n1"))
        assert mon.receive(encode_beat(key, run, 1, "n2"))
        clock.now += 9.0
        assert mon.lost() == []  # n3 not heard yet, but inside its startup
        assert mon.receive(encode_beat(key, run, 2, "n1"))
        clock.now += 2.0  # n2 silent 11 s, n1 2 s
        assert mon.lost() == ["n2"]
        assert mon.lost(["n1"]) == []
        clock.now += 20.0  # 31 s since the start: n3 never came up
        assert mon.lost() == ["n1", "n2", "n3"]
    finally:
        mon.close()


def test_a_replayed_or_foreign_beat_does_not_keep_a_dead_node_alive() -> None:
    clock = Clock()
    mon = HeartbeatMonitor("127.0.0.1", ["n1"], 10.0, clock=clock)
    try:
        key, run = mon.secret, b"b" * 8
        old = encode_beat(key, run, 5, "n1")
        assert mon.receive(old)
        clock.now += 11.0
        assert not mon.receive(old)  # the same datagram again
        assert not mon.receive(encode_beat(key, run, 4, "n1"))  # an older one
        assert not mon.receive(encode_beat(os.urandom(32), run, 6, "n1"))  # forged
        assert not mon.receive(encode_beat(key, run, 9, "n9"))  # not a node of the job
        assert mon.lost() == ["n1"]
        assert mon.receive(encode_beat(key, b"c" * 8, 1, "n1"))  # a new agent run
        assert mon.lost() == []
    finally:
        mon.close()


def test_bad_endpoints_are_refused() -> None:
    for bad in ("", "host", "h:0:" + "00" * 32, "h:70000:" + "00" * 32, "h:1:zz", "h:1:00"):
        try:
            parse_endpoint(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted")
    assert parse_endpoint("10.0.0.1:4000:" + "ab" * 16) == ("10.0.0.1", 4000, b"\xab" * 16)


def _agent(endpoint: str, node: str) -> subprocess.Popen:
    env = dict(os.environ, SLURMD_NODENAME=node, **{HEARTBEAT_ENV: endpoint})
    return subprocess.Popen([sys.executable, "-m", "slurm_ckpt.ops.heartbeat"], env=env)


def _until(pred, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def test_real_agents_over_udp_a_stopped_one_is_lost_the_other_is_not() -> None:
    mon = HeartbeatMonitor("127.0.0.1", ["n1", "n2"], 3.0, startup_s=60.0)
    agents = [_agent(mon.endpoint, "n1"), _agent(mon.endpoint, "n2")]
    try:
        _until(lambda: mon.heard("n1") and mon.heard("n2"), "both agents heard")
        assert mon.lost() == []
        os.kill(agents[1].pid, signal.SIGSTOP)  # n2 stops answering, its process lives
        _until(lambda: mon.lost() != [], "a silent node found")
        assert mon.lost() == ["n2"]
        os.kill(agents[1].pid, signal.SIGCONT)
        _until(lambda: mon.lost() == [], "n2 heard again")
    finally:
        for a in agents:
            os.kill(a.pid, signal.SIGCONT)
            a.kill()
            a.wait()
        mon.close()


def test_an_agent_without_its_endpoint_says_so_in_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if k != HEARTBEAT_ENV}
    r = subprocess.run(
        [sys.executable, "-m", "slurm_ckpt.ops.heartbeat"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r
    assert r.stderr.strip().splitlines() == [
        f"ckpt-srun heartbeat: ${HEARTBEAT_ENV} is missing or malformed"
    ]
