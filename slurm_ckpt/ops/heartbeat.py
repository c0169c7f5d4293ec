"""Node heartbeats for ``ckpt-srun --spares``: the job notices a dead node itself, in seconds.

Why: SLURM declares a node dead only after ``SlurmdTimeout`` (300 s by default) of
silence from its slurmd, and until then a step that lost a node's tasks neither ends nor
lets a new step have the nodes. A job that waits for SLURM's verdict loses minutes per
node loss; a real node death (slurmd and every process killed, nobody marking it DOWN)
left the relaunch waiting for ever. Heartbeats need no admin rights and no cooperation
from the training program:

* ckpt-srun (on the batch host) listens on a UDP port (:class:`HeartbeatMonitor`);
* one agent per node of the allocation (:func:`run_agent`, started by ckpt-srun as an
  ``srun --overlap`` step of its own on that node, beside the training step, spares
  included) sends a datagram every :data:`BEAT_S` seconds naming its node;
* a node none of whose datagrams arrived for ``timeout_s`` is lost.

Each datagram carries a MAC under a secret that only this job's processes hold (it
reaches the agents through their environment, which only the job's user and root can
read), and a sequence number that only grows per agent run: another user on the network
can neither forge a node's heartbeat nor replay an old one to hide a death. A datagram
that fails the check is dropped without a word (nothing is said to the sender). A node
that was never heard from is given ``startup_s`` (the agent step's launch) before it
counts as lost.

One step per node, not one step over every node: when SLURM at last declares a dead node
DOWN (``SlurmdTimeout`` later), it kills every step that had a task there. With one step
over all nodes that ended every agent, and ckpt-srun, hearing no node at all, took the
whole job for lost (the seed-2 benchmark's relaunch arm, 122 s after its first loss).

A lost node is *excluded*: ckpt-srun stops the step and relaunches it without that node.
A node that is only slow or cut off and comes back does not rejoin the step; it is
listed as lost for the rest of the job.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = [
    "BEAT_S",
    "HEARTBEAT_ENV",
    "HeartbeatMonitor",
    "Heartbeats",
    "agent_argv",
    "parse_endpoint",
    "run_agent",
]

#: The agents' environment variable: ``HOST:PORT:SECRET_HEX``.
HEARTBEAT_ENV = "SLURM_CKPT_HEARTBEAT"
#: Seconds between two datagrams of one agent.
BEAT_S = 1.0
_MAGIC = b"SCHB1"
_MAC_LEN = 16
_MAX_NODE = 255
#: Datagram: magic, run id (8 bytes), sequence (u64), node length (u8), node, MAC.
_HEAD = struct.Struct("!5s8sQB")


def _mac(secret: bytes, body: bytes) -> bytes:
    return hmac.new(secret, body, hashlib.sha256).digest()[:_MAC_LEN]


def encode_beat(secret: bytes, run_id: bytes, seq: int, node: str) -> bytes:
    """One heartbeat datagram (see the module docstring)."""
    name = node.encode()[:_MAX_NODE]
    body = _HEAD.pack(_MAGIC, run_id, seq, len(name)) + name
    return body + _mac(secret, body)


def decode_beat(secret: bytes, data: bytes) -> Optional[Tuple[bytes, int, str]]:
    """``(run_id, seq, node)`` of a datagram whose MAC checks, else None."""
    if len(data) < _HEAD.size + _MAC_LEN or len(data) > _HEAD.size + _MAX_NODE + _MAC_LEN:
        return None
    body, mac = data[:-_MAC_LEN], data[-_MAC_LEN:]
    if not hmac.compare_digest(mac, _mac(secret, body)):
        return None
    magic, run_id, seq, n = _HEAD.unpack_from(body)
    if magic != _MAGIC or len(body) != _HEAD.size + n:
        return None
    try:
        node = body[_HEAD.size :].decode()
    except UnicodeDecodeError:
        return None
    return run_id, seq, node


def parse_endpoint(value: str) -> Tuple[str, int, bytes]:
    """``HOST:PORT:SECRET_HEX`` -> its parts; ValueError on anything else."""
    host, port, secret = value.rsplit(":", 2)
    key = bytes.fromhex(secret)
    if not host or not 0 < int(port) < 65536 or len(key) < 16:
        raise ValueError("bad heartbeat endpoint")
    return host, int(port), key


class HeartbeatMonitor:
    """Receives the agents' heartbeats and says which nodes fell silent.

    ``nodes`` are the nodes expected to beat; ``clock`` is injectable so the verdict's
    arithmetic is tested without waiting."""

    def __init__(
        self,
        host: str,
        nodes: Sequence[str],
        timeout_s: float,
        startup_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self.startup_s = max(startup_s, timeout_s)
        self.clock = clock
        self.secret = os.urandom(32)
        self.started = clock()
        self._last: Dict[str, float] = {}
        self._seq: Dict[str, Tuple[bytes, int]] = {}
        self._expected = set(nodes)
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((host, 0))
        self._sock.settimeout(0.5)
        self.host, self.port = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ckpt-heartbeat", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The agents' :data:`HEARTBEAT_ENV` value."""
        return f"{self.host}:{self.port}:{self.secret.hex()}"

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(512)
            except socket.timeout:
                continue
            except OSError:
                return
            self.receive(data)

    def receive(self, data: bytes) -> bool:
        """Take one datagram; True when it counted (authentic, newer, an expected node)."""
        beat = decode_beat(self.secret, data)
        if beat is None:
            return False
        run_id, seq, node = beat
        with self._lock:
            if node not in self._expected:
                return False
            last = self._seq.get(node)
            if last is not None and last[0] == run_id and seq <= last[1]:
                return False  # a replay, or out of order
            self._seq[node] = (run_id, seq)
            self._last[node] = self.clock()
        return True

    def heard(self, node: str) -> bool:
        with self._lock:
            return node in self._last

    def last_heard_wall(self, node: str) -> Optional[float]:
        """When ``node`` was last heard from, as epoch seconds (None: never)."""
        with self._lock:
            last = self._last.get(node)
        return None if last is None else time.time() - (self.clock() - last)

    def lost(self, nodes: Optional[Sequence[str]] = None) -> List[str]:
        """Those of ``nodes`` (default: every expected node) silent past the timeout."""
        now = self.clock()
        out = []
        with self._lock:
            for node in nodes if nodes is not None else sorted(self._expected):
                last = self._last.get(node)
                if last is None:
                    if now - self.started > self.startup_s:
                        out.append(node)
                elif now - last > self.timeout_s:
                    out.append(node)
        return out

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2)


def agent_argv(srun: str, node: str) -> List[str]:
    """One node's agent step: one task on ``node``, overlapping the training step
    (``--overlap``: it shares the allocation's CPUs and memory instead of waiting). A
    step of its own per node, so that SLURM ending a dead node's steps ends no other
    node's agent (module docstring)."""
    return [
        srun,
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        "--kill-on-bad-exit=0",
        "--quiet",
        sys.executable,
        "-m",
        "slurm_ckpt.ops.heartbeat",
    ]


def batch_host_address(client: Any, node: Optional[str]) -> str:
    """The address the other nodes reach this one at: SLURM's ``NodeAddr`` for it (what
    slurmd itself is reached at), else what the host name resolves to."""
    if node:
        try:
            addr = client.node(node).raw.get("NodeAddr")
        except Exception:  # noqa: BLE001 - any failure: fall back to the host name
            addr = None
        if addr and addr != "(null)":
            with contextlib.suppress(OSError):
                return socket.gethostbyname(str(addr))
    return socket.gethostbyname(socket.gethostname())


@dataclass
class Heartbeats:
    """The monitor on the batch host and the agents' step on every node of the job."""

    monitor: HeartbeatMonitor
    agents: List[subprocess.Popen]

    @classmethod
    def start(
        cls,
        client: Any,
        jenv: Any,
        srun: str,
        env: Dict[str, str],
        timeout_s: float,
        say: Callable[[str], None],
    ) -> Optional[Heartbeats]:
        """Listen, and launch one agent step per node of the allocation; None (said why)
        when the port cannot be opened or srun cannot be started: the job then waits for
        SLURM's verdict as before."""
        try:
            monitor = HeartbeatMonitor(batch_host_address(client, jenv.node), jenv.nodes, timeout_s)
        except OSError as exc:
            say(f"no heartbeats ({exc}): a lost node is found when SLURM declares it dead")
            return None
        agent_env = dict(env)
        agent_env[HEARTBEAT_ENV] = monitor.endpoint
        beats = cls(monitor, [])
        for node in jenv.nodes:
            try:
                beats.agents.append(
                    subprocess.Popen(
                        agent_argv(srun, node),
                        env=agent_env,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,  # the batch shell's signals are not theirs
                    )
                )
            except OSError as exc:
                beats.stop()
                say(f"no heartbeats ({exc}): a lost node is found when SLURM declares it dead")
                return None
        say(
            f"heartbeats from {len(jenv.nodes)} node(s) to {monitor.host}:{monitor.port}; "
            f"a node silent for {timeout_s:.0f}s is lost"
        )
        return beats

    def stop(self) -> None:
        """End the agents' steps and close the port (bounded: the sruns still running
        5 s after SIGTERM are killed)."""
        live = [p for p in self.agents if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.monitor.close()


def run_agent(
    endpoint: str,
    node: str,
    beats: Optional[int] = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Send this node's heartbeat every :data:`BEAT_S` seconds (``beats``: that many,
    then return; None: until killed). A send that fails is retried at the next beat."""
    host, port, secret = parse_endpoint(endpoint)
    run_id = os.urandom(8)
    addr = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        seq = 0
        while beats is None or seq < beats:
            seq += 1
            with contextlib.suppress(OSError):  # retried at the next beat
                sock.sendto(encode_beat(secret, run_id, seq, node), addr)
            sleep(BEAT_S)
    return 0


def main() -> int:
    """Entry point of the agent step (``python -m slurm_ckpt.ops.heartbeat``)."""
    endpoint = os.environ.get(HEARTBEAT_ENV, "")
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        return run_agent(endpoint, node)
    except ValueError:
        print(f"ckpt-srun heartbeat: ${HEARTBEAT_ENV} is missing or malformed", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
