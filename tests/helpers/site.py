"""The one site builder of the tests: tier directories, a config file for them, and
checkpoints written through the real writer.

    site = Site(tmp_path)                       # local + pfs under tmp_path, c.toml
    site.write(3, user="alice", key="run")      # a committed checkpoint on the local tier
    site.copy(3, user="alice", key="run")       # verified copy local -> pfs
    monkeypatch.setenv("SLURM_CKPT_CONFIG", str(site.cfg_path))

Tests that need real filesystems pass ``roots`` (mount points from the ``mounts``
fixture); tests that need more config pass ``extra`` TOML.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Iterable, Mapping, Optional

from slurm_ckpt.core.config import Config, load_config
from slurm_ckpt.core.layout import step_dirname
from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.ledger import Ledger
from slurm_ckpt.tiers.copy import CopyResult, copy_checkpoint
from slurm_ckpt.tiers.posix import PosixTier


class Site:
    """A site on plain directories (or given mounts) with its config file."""

    def __init__(
        self,
        base: Path,
        *,
        tiers: Iterable[str] = ("local", "pfs"),
        roots: Optional[Mapping[str, Path]] = None,
        extra: str = "",
        config_name: str = "c.toml",
    ) -> None:
        self.base = Path(base)
        self.roots: Dict[str, Path] = {}
        for name in tiers:
            root = Path(roots[name]) if roots and name in roots else self.base / name
            root.mkdir(parents=True, exist_ok=True)
            self.roots[name] = root
        text = (
            f'[tiers.local]\nroot = "{self.roots["local"]}"\nrequire_mount = false\nmin_free = 0\n'
        )
        for name in ("pfs", "cold"):
            if name in self.roots:
                text += f'[tiers.{name}]\nroot = "{self.roots[name]}"\n'
        self.cfg_path = self.base / config_name
        self.cfg_path.write_text(text + extra)

    # -- what was built ----------------------------------------------------------------
    def load(self) -> Config:
        """The site's config, loaded and validated as the tools load it."""
        return Config.load(self.cfg_path)

    def tier(self, name: str, **kw: object) -> PosixTier:
        return PosixTier(name, str(self.roots[name]), **kw)  # type: ignore[arg-type]

    @property
    def local(self) -> PosixTier:
        return self.tier("local")

    @property
    def pfs(self) -> PosixTier:
        return self.tier("pfs")

    @property
    def cold(self) -> PosixTier:
        return self.tier("cold")

    def step_dir(
        self, step: int, *, user: str = "alice", key: str = "run", tier: str = "local"
    ) -> Path:
        return self.roots[tier] / user / key / step_dirname(step)

    def ledger(self, node: str = "n1", directory: Optional[Path] = None) -> Ledger:
        return Ledger(directory or self.base / f"ledger-{node}", node)

    # -- building ----------------------------------------------------------------------
    def write(
        self,
        step: int,
        *,
        user: str = "alice",
        key: str = "run",
        tier: str = "local",
        files: Optional[Mapping[str, bytes]] = None,
        nbytes: int = 1000,
        **manifest: object,
    ) -> Manifest:
        """Commit a checkpoint through the tier's real writer: ``files``, else one random
        ``model.bin`` of ``nbytes``; ``manifest`` fields (tokens, job, node, meta)."""
        payload = files if files is not None else {"model.bin": os.urandom(nbytes)}
        with self.tier(tier).writer(user, key, step, **manifest) as w:
            w.write_buffers(dict(payload))
            return w.commit()

    def copy(
        self,
        step: int,
        *,
        user: str = "alice",
        key: str = "run",
        src: str = "local",
        dst: str = "pfs",
    ) -> CopyResult:
        return copy_checkpoint(self.tier(src), self.tier(dst), user, key, step)


def write_config(path: Path, data: Mapping[str, Mapping[str, object]]) -> Config:
    """Write ``{"tiers.local": {...}, ...}`` as the site's TOML config at ``path`` (mode
    0644: the job users read it; replaced atomically, as a running hook may read it) and
    load it back: the cluster sites' one way to (re)configure."""

    def val(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        return str(v) if isinstance(v, (int, float)) else f'"{v}"'

    text = "".join(
        f"[{name}]\n" + "".join(f"{k} = {val(v)}\n" for k, v in values.items())
        for name, values in data.items()
    )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return load_config(path)
