"""The one site builder of the tests: tier directories, a config file for them, and
checkpoints written through the real writer (:class:`Site`); and its form for root's
hooks against real users (:class:`HookSite`: the security suite's 1777 PFS, the
object-store suite's bucket prefix). The fault campaign's cluster site
(``tests/faults/site.FaultSite``) builds whole SLURM nodes instead.

    site = Site(tmp_path)                       # local + pfs under tmp_path, c.toml
    site.write(3, user="alice", key="run")      # a committed checkpoint on the local tier
    site.copy(3, user="alice", key="run")       # verified copy local -> pfs
    monkeypatch.setenv("SLURM_CKPT_CONFIG", str(site.cfg_path))

Tests that need real filesystems pass ``roots`` (mount points from the ``mounts``
fixture); tests that need more config pass ``extra`` TOML.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional

from slurm_ckpt.core.config import Config, load_config
from slurm_ckpt.core.config_schema import SECTION_KINDS
from slurm_ckpt.core.layout import step_dirname
from slurm_ckpt.core.manifest import Manifest
from slurm_ckpt.core.names import user_ids
from slurm_ckpt.ledger import Ledger
from slurm_ckpt.slurm.env import HookEnv
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
                text += f'[tiers.{name}]\nkind = "posix"\nroot = "{self.roots[name]}"\n'
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


def with_kinds(data: Mapping[str, Mapping[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """``{"tiers.pfs": {...}, ...}`` with each shared tier's ``kind`` said, as a site's
    config says it today (docs/admin-guide.md); a section that names its own kind keeps
    it. The old form (no kind) is for the alias tests to write, on purpose."""
    out = {name: dict(values) for name, values in data.items()}
    for name, values in out.items():
        tier = name[len("tiers.") :] if name.startswith("tiers.") else ""
        if tier in SECTION_KINDS and tier != "local":
            values.setdefault("kind", SECTION_KINDS[tier])
    return out


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
        for name, values in with_kinds(data).items()
    )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return load_config(path)


class HookSite:
    """A site for root-run code (hooks, stager, root's CLI) over real users' data: a
    local tier at ``local``, the warm tier(s) of :meth:`warm_tiers`, and the config as
    a dict (:meth:`data`), a :class:`Config` (:meth:`cfg`) or a root-owned TOML file
    (:meth:`config_file`). ``sections`` override: a tier's name updates that tier
    (``pfs={...}``, ``object={...}``), any other name that section."""

    #: Sections every config of the site starts from (a subclass sets its own).
    defaults: Dict[str, Dict[str, Any]] = {}

    def __init__(self, base: Path, local: Path, node: str = "n1") -> None:
        self.base, self.local, self.node = Path(base), Path(local), node

    def warm_tiers(self) -> Dict[str, Dict[str, Any]]:
        """The shared tiers' sections, read when a config is made (a test may swap a
        tier's root before it asks for the config)."""
        return {}

    def data(self, **sections: Any) -> Dict[str, Any]:
        tiers: Dict[str, Dict[str, Any]] = {
            "local": {"root": str(self.local), "min_free": 0},
            **self.warm_tiers(),
        }
        data: Dict[str, Any] = {"tiers": tiers, **copy.deepcopy(self.defaults)}
        for name, values in sections.items():
            if name in tiers:
                tiers[name].update(values)
            else:
                data.setdefault(name, {}).update(values)
        for name, values in tiers.items():  # today's form: each shared tier says its kind
            if name in SECTION_KINDS and name != "local" and isinstance(values, dict):
                values.setdefault("kind", SECTION_KINDS[name])
        return data

    def cfg(self, **sections: Any) -> Config:
        return Config.from_dict(self.data(**sections))

    def config_file(self, path: Optional[Path] = None, **sections: Any) -> Path:
        """The config as a TOML file (mode 0644), root's (for the CLI and the hooks)."""
        path = path or self.base / "site.toml"
        data = self.data(**sections)
        lines: List[str] = []
        for tier, values in data.pop("tiers").items():
            lines.append(f"[tiers.{tier}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        for name, values in data.items():
            lines.append(f"[{name}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        path.write_text("\n".join(lines) + "\n")
        os.chmod(path, 0o644)
        return path

    def env(self, user: str, job: str = "100", restart: int = 0) -> HookEnv:
        """The hook environment slurmd gives a job of ``user`` on this site's node."""
        u = user_ids(user)
        return HookEnv(job, u.name, u.uid, u.gid, self.node, [self.node], restart)

    def ledger(self, cfg: Config) -> Ledger:
        return Ledger(cfg.ledger.dir, self.node)
