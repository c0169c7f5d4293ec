"""The network half of partner copies: who partners whom, the per-job secret and where
each rank listens (the handshake and the encrypted channel: :mod:`.partner_wire`).

Node-local disks are private, so a partner copy travels between the job's own processes.
They find each other through a **rendezvous directory** on a filesystem every node of the
job mounts (by default below the user's own PFS directory): each rank publishes its node
and listening address there, and the first rank to get there creates the job's secret,
32 random bytes in a file only the user can read (``0600`` in a ``0700`` directory the
user owns; anything else is refused). Every connection proves knowledge of that secret
both ways, bound to the two ranks, the launch and the series, before a single byte of
data is accepted or sent, and everything after travels encrypted and authenticated
(:mod:`.partner_wire`); each chunk is also checked against the manifest's digests before
anything is committed.

Partners form a ring over the job's *nodes* (sorted names): the ranks of node ``i`` send
to the ranks of node ``i+1`` (the k-th rank of a node to the k-th of the next, modulo its
count), so ranks on one node never partner each other. One node: no partner.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import stat
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from slurm_ckpt.core import fsio, trust
from slurm_ckpt.errors import CkptError
from slurm_ckpt.job.partner_wire import WireError

__all__ = [
    "Peer",
    "Rendezvous",
    "WireError",
    "launch_tag",
    "no_delay",
    "ring_partner",
]

SECRET_BYTES = 32
#: How often a rank looks for the others' rendezvous files while it waits for them.
POLL_S = 0.2
#: The in-job recovery's membership epoch of this process (set by job/recovery.py).
EPOCH_ENV = "SLURM_CKPT_EPOCH"
#: The launch every rank of a ckpt-srun --in-job run shares (its ranks run one step each).
LAUNCH_ENV = "SLURM_CKPT_LAUNCH"


@dataclass(frozen=True)
class Peer:
    """One rank of the job as published in the rendezvous directory."""

    rank: int
    node: str
    host: str
    port: int


def ring_partner(peers: Dict[int, Peer], rank: int) -> Optional[Peer]:
    """The rank this one sends its copies to (see the module docstring), or None."""
    me = peers[rank]
    nodes = sorted({p.node for p in peers.values()})
    if len(nodes) < 2:
        return None
    nxt = nodes[(nodes.index(me.node) + 1) % len(nodes)]
    mine = sorted(r for r, p in peers.items() if p.node == me.node)
    theirs = sorted(r for r, p in peers.items() if p.node == nxt)
    return peers[theirs[mine.index(rank) % len(theirs)]]


class Rendezvous:
    """The job's rendezvous directory: the secret and one address file per rank."""

    def __init__(
        self,
        directory: str,
        rank: int,
        world_size: int,
        launch: str = "",
        *,
        base: Optional[str] = None,
        user: Optional[str] = None,
    ) -> None:
        self.dir = os.path.abspath(directory)
        self.rank, self.world_size = rank, world_size
        #: Which launch of the job's ranks this is (:func:`launch_tag`): a step that
        #: ckpt-srun relaunched after a node loss keeps the directory, and the lost
        #: ranks' old addresses there must not be taken for the new ones.
        self.launch = launch
        #: The trusted directory the rendezvous lies below (``[partner] dir`` or the PFS
        #: root, made by the admin); every component below it is opened without
        #: following a symlink and must be ours (see :meth:`_open`).
        self.base = os.path.abspath(base) if base is not None else os.path.dirname(self.dir)
        rel = os.path.relpath(self.dir, self.base)
        if rel.startswith("..") or rel == ".":
            raise CkptError(f"partner rendezvous {self.dir}: not below {self.base}")
        self.parts = rel.split(os.sep)
        #: The user whose directory ``<base>/<user>`` is the first component (when set):
        #: one another user made first is *squatted* and refused (:class:`Squatted`).
        self.user = user

    def _open(self) -> int:
        """The directory, created ``0700`` if absent. Below :attr:`base` no symlink is
        followed, and every component must be a real directory of ours (the last one
        closed to everyone else); ``<base>/<user>`` made first by another user is
        refused as squatted (partner copies are then off, and ``status``/``doctor``
        report it)."""
        os.makedirs(self.base, mode=0o700, exist_ok=True)
        fd = fsio.open_dir(self.base)  # trusted (the admin's or the PFS root)
        try:
            for i, part in enumerate(self.parts):
                last = i == len(self.parts) - 1
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o700, dir_fd=fd)
                nfd = os.open(part, fsio.O_DIR, dir_fd=fd)  # a planted symlink fails here
                os.close(fd)
                fd = nfd
                where = os.path.join(self.base, *self.parts[: i + 1])
                st = os.fstat(fd)
                if i == 0 and self.user is not None:
                    owner = trust.squatter(st, self.user)
                    if owner is not None:
                        raise trust.Squatted(
                            "partner rendezvous " + trust.squat_message(where, self.user, owner)
                        )
                    if st.st_uid == trust.ROOT_UID and os.geteuid() != trust.ROOT_UID:
                        continue  # the user's directory, made for them by root
                # Ours (a directory swapped in by someone else is refused); the run's
                # own directory closed to everyone else, as the secret needs.
                mode = stat.S_IMODE(st.st_mode)
                if st.st_uid != os.geteuid() or (last and mode & 0o077):
                    raise CkptError(
                        f"partner rendezvous {where}: must be owned by uid {os.geteuid()}"
                        f"{' with mode 0700' if last else ''} (uid {st.st_uid}, mode {mode:o})"
                    )
            return fd
        except BaseException:
            os.close(fd)
            raise

    def secret(self) -> bytes:
        """The job's secret, created by whoever comes first (atomically: written to a
        temporary file, then linked into place, so no one ever reads half of it)."""
        fd = self._open()
        try:
            tmp = fsio.temp_name("secret")
            tfd = os.open(tmp, fsio.O_NEWFILE, 0o600, dir_fd=fd)
            try:
                fsio.write_all(tfd, secrets.token_bytes(SECRET_BYTES))
                os.fsync(tfd)
            finally:
                os.close(tfd)
            try:
                os.link(tmp, "secret", src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
            except FileExistsError:
                pass
            finally:
                fsio.unlink_quiet(fd, tmp)
            data, st = fsio.read_regular(fd, "secret", limit=SECRET_BYTES + 1)
            if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
                raise CkptError(f"partner rendezvous {self.dir}/secret: not ours or not 0600")
            if len(data) != SECRET_BYTES:
                raise CkptError(f"partner rendezvous {self.dir}/secret: wrong size")
            return data
        finally:
            os.close(fd)

    def publish(self, node: str, host: str, port: int) -> None:
        fd = self._open()
        try:
            doc = {"rank": self.rank, "node": node, "host": host, "port": port}
            doc["launch"] = self.launch
            fsio.atomic_replace(fd, f"rank-{self.rank}.json", json.dumps(doc).encode())
        finally:
            os.close(fd)

    def peers(self, timeout: float, stop: Callable[[], bool] = lambda: False) -> Dict[int, Peer]:
        """Every rank's address, waiting up to ``timeout`` seconds for all to publish, or
        until ``stop()`` says this rank is closing (a rank that closed first has withdrawn
        its address: waiting on for it would hold this rank's close for the timeout)."""
        until = time.monotonic() + timeout
        while True:
            got = self._read_all()
            if len(got) == self.world_size:
                return got
            if stop():
                raise CkptError(
                    f"partner rendezvous {self.dir}: closing with {len(got)} of "
                    f"{self.world_size} ranks published"
                )
            if time.monotonic() >= until:
                raise CkptError(
                    f"partner rendezvous {self.dir}: {len(got)} of {self.world_size} ranks "
                    f"published within {timeout:.0f}s"
                )
            time.sleep(POLL_S)

    def _read_all(self) -> Dict[int, Peer]:
        fd = self._open()
        out: Dict[int, Peer] = {}
        try:
            for r in range(self.world_size):
                try:
                    data, _st = fsio.read_regular(fd, f"rank-{r}.json", limit=4096)
                    doc = json.loads(data)
                    if doc.get("launch", "") != self.launch:
                        continue  # an address of an earlier launch (a lost node's)
                    out[r] = Peer(r, str(doc["node"]), str(doc["host"]), int(doc["port"]))
                except (OSError, ValueError, KeyError, TypeError, CkptError):
                    continue
        finally:
            os.close(fd)
        return out

    def withdraw(self) -> None:
        """Remove this rank's address file (at close)."""
        try:
            fd = self._open()
        except (OSError, CkptError):
            return
        try:
            fsio.unlink_quiet(fd, f"rank-{self.rank}.json")
        finally:
            os.close(fd)


def launch_tag() -> str:
    """This launch of the ranks: the SLURM step and ckpt-srun's relaunch count (every
    rank of one launch sees the same; a relaunch after a node loss differs)."""
    # ckpt-srun --in-job runs one step per node (slurm_ckpt.ops.in_job): the ranks' step
    # ids differ, so it names their common launch in SLURM_CKPT_LAUNCH instead.
    step = os.environ.get(LAUNCH_ENV) or os.environ.get("SLURM_STEP_ID", "")
    tag = f"{step}/{os.environ.get('SLURM_CKPT_RELAUNCH', '0')}"
    epoch = os.environ.get(EPOCH_ENV, "")
    # In-job recovery (job/recovery.py): the membership epoch too, so that sessions of
    # processes of different epochs never authenticate.
    return f"{tag}/e{epoch}" if epoch.isdigit() else tag


def local_host() -> str:
    """An address other nodes reach this one at: the host name's address."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def no_delay(sock: socket.socket) -> socket.socket:
    """Small frames go out at once: the protocol answers a request with a status byte and
    then a frame, and Nagle's algorithm would hold the frame until the peer's delayed ACK
    of the byte (40 ms on Linux), per request."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def listening_socket(host: str) -> socket.socket:
    """A TCP socket listening on an ephemeral port of ``host`` ('' = every interface)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(16)
    return sock
