"""Site configuration: one TOML file, typed, validated, frozen.

The file is ``/etc/slurm-ckpt/config.toml`` unless the environment variable
``SLURM_CKPT_CONFIG`` or an explicit path names another one. Sizes, bandwidths and
durations may be written the way people write them (``"64MiB"``, ``"500MB/s"``, ``"6h"``,
``"1-00:00:00"``; the grammar of :mod:`slurm_ckpt.core.units`) or as unquoted TOML
numbers, which mean bytes, bytes per second and seconds. A quoted number without a unit
(``"1000"``) is refused, except ``"0"``: a string is what people write, and there the
unit must be said.

Every problem in a file is collected and reported at once, as a single one-line
:class:`~slurm_ckpt.errors.ConfigError` whose parts are separated by ``"; "`` and each name
the file and the key. Library users who have no file at all build a configuration with
:meth:`Config.standalone`, which runs the very same validation.

See ``etc/config.toml`` for an annotated example with every key and its default.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from slurm_ckpt.core.config_parse import all_keys, parse_section, unknown_key
from slurm_ckpt.core.config_schema import (  # noqa: F401 - the section classes are re-exported
    DEFAULT_CONFIG_PATH,
    ENV_CONFIG,
    LEDGER_SUBDIR,
    OBJECT_SECTION,
    PFS,
    SECTION_CLASSES,
    STANDALONE_SOURCE,
    TIER_CLASSES,
    TOP_KEYS,
    AdmissionConfig,
    ColdTierConfig,
    CopyConfig,
    HooksConfig,
    JobConfig,
    LedgerConfig,
    LocalTierConfig,
    ManifestsConfig,
    MetricsConfig,
    ObjectTierConfig,
    PartnerConfig,
    PathLike,
    PfsTierConfig,
    RetentionConfig,
    TiersConfig,
    section_to_dict,
    tiers_to_dict,
)
from slurm_ckpt.core.config_tiers import parse_tiers
from slurm_ckpt.core.manifest_limits import ManifestLimits, set_limits
from slurm_ckpt.errors import ConfigError

if sys.version_info >= (3, 11):  # pragma: no cover - depends on the interpreter
    import tomllib as _toml
else:  # pragma: no cover
    import tomli as _toml

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "AdmissionConfig",
    "ENV_CONFIG",
    "ColdTierConfig",
    "Config",
    "CopyConfig",
    "HooksConfig",
    "JobConfig",
    "LedgerConfig",
    "LocalTierConfig",
    "ManifestsConfig",
    "MetricsConfig",
    "ObjectTierConfig",
    "PfsTierConfig",
    "RetentionConfig",
    "TiersConfig",
    "config_origin",
    "load_config",
    "own_config_path",
    "resolve_config_path",
    "user_config_path",
]

# --------------------------------------------------------------------------- Config


@dataclass(frozen=True)
class Config:
    """The whole, validated site configuration. Build it with :func:`load_config`,
    :meth:`Config.load`, :meth:`Config.from_dict` or :meth:`Config.standalone`."""

    tiers: TiersConfig
    ledger: LedgerConfig
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    copy: CopyConfig = field(default_factory=CopyConfig)
    job: JobConfig = field(default_factory=JobConfig)
    hooks: HooksConfig = field(default_factory=HooksConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    manifests: ManifestsConfig = field(default_factory=ManifestsConfig)
    partner: PartnerConfig = field(default_factory=PartnerConfig)
    #: The file this came from, or "<standalone>"/"<dict>"; not part of equality.
    source: str = field(default="<dict>", compare=False)

    # -- constructors ----------------------------------------------------------------

    @classmethod
    def load(cls, path: Optional[PathLike] = None) -> Config:
        """Read and validate a file (explicit path, else $SLURM_CKPT_CONFIG, else default)."""
        return load_config(path)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "<dict>") -> Config:
        """Validate a TOML-shaped mapping (as ``tomllib`` returns, or :meth:`to_dict`)."""
        return _build(data, source)

    @classmethod
    def standalone(
        cls, local: PathLike, pfs: Optional[PathLike] = None, **overrides: Any
    ) -> Config:
        """A configuration without any file, for library use on plain directories.

        ``local`` and ``pfs`` may be relative (they are made absolute); without ``pfs``
        give ``tiers={"object": {...}}`` (a site without a parallel filesystem). The local tier
        defaults to ``require_mount=False`` and ``min_free=0``, since a plain directory is
        expected. ``overrides`` are TOML-shaped sections, each a dict or the section's
        dataclass, e.g. ``retention={"keep_local": 3}``, ``copy=CopyConfig(streams=8)``,
        ``tiers={"local": {"min_free": "1GiB"}, "cold": {"root": "/archive"}}``.
        """
        data: Dict[str, Any] = {
            "tiers": {
                "local": {
                    "root": os.path.abspath(os.fspath(local)),
                    "require_mount": False,
                    "min_free": 0,
                },
            }
        }
        if pfs is not None:
            data["tiers"][PFS] = {"root": os.path.abspath(os.fspath(pfs))}
        problems: List[str] = []
        for name, value in overrides.items():
            if name not in TOP_KEYS:
                problems.append(unknown_key(STANDALONE_SOURCE, "", name, TOP_KEYS))
                continue
            if isinstance(value, TiersConfig):
                value = tiers_to_dict(value)
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                value = section_to_dict(value)
            if name == "tiers" and isinstance(value, Mapping):
                tiers = data["tiers"]
                for tier, tvalue in value.items():
                    if dataclasses.is_dataclass(tvalue) and not isinstance(tvalue, type):
                        tvalue = section_to_dict(tvalue)
                    if isinstance(tiers.get(tier), dict) and isinstance(tvalue, Mapping):
                        tiers[tier] = {**tiers[tier], **tvalue}
                    else:
                        tiers[tier] = tvalue
            else:
                data[name] = value
        if problems:
            raise ConfigError("; ".join(problems))
        return _build(data, STANDALONE_SOURCE)

    # -- output ----------------------------------------------------------------------

    def to_dict(self, human: bool = False) -> Dict[str, Any]:
        """The effective configuration with every default filled in.

        Plain JSON/TOML-shaped values: paths as strings, sizes in bytes, bandwidths in
        bytes/s, durations in seconds, None for unset optional keys and absent optional
        tiers. ``Config.from_dict(cfg.to_dict()) == cfg``. With ``human=True`` sizes,
        bandwidths and durations are formatted for people instead (not parseable back).
        """
        out: Dict[str, Any] = {"tiers": tiers_to_dict(self.tiers, human)}
        for name in SECTION_CLASSES:
            out[name] = section_to_dict(getattr(self, name), human)
        return out

    @property
    def ledger_dir(self) -> Path:
        """Shortcut for ``self.ledger.dir``."""
        return self.ledger.dir


# --------------------------------------------------------------------------- loading


def resolve_config_path(path: Optional[PathLike] = None) -> Tuple[Path, str]:
    """Which file to read, and why: ``(path, origin)`` where origin is ``"explicit"``,
    ``"env"`` (from $SLURM_CKPT_CONFIG) or ``"default"``."""
    if path is not None and os.fspath(path) != "":
        return Path(os.fspath(path)), "explicit"
    env = os.environ.get(ENV_CONFIG, "")
    if env.strip():
        return Path(env), "env"
    return DEFAULT_CONFIG_PATH, "default"


def user_config_path() -> Path:
    """The per-user config file: ``$XDG_CONFIG_HOME/slurm-ckpt/config.toml``, else
    ``~/.config/slurm-ckpt/config.toml``."""
    base = os.environ.get("XDG_CONFIG_HOME", "")
    if not base or not os.path.isabs(base):  # the XDG spec: a relative value is ignored
        base = os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "slurm-ckpt" / "config.toml"


def own_config_path() -> Optional[Path]:
    """The user's own config when it is the one to read, else None: not root (root
    never reads a user's file), no ``$SLURM_CKPT_CONFIG``, no site default, and the file
    exists. The one rule the user commands and ``Checkpointer.from_env()`` share."""
    if os.environ.get(ENV_CONFIG, "").strip() or os.geteuid() == 0:
        return None
    if os.path.lexists(DEFAULT_CONFIG_PATH):
        return None
    user = user_config_path()
    return user if os.path.lexists(user) else None


def config_origin(path: Optional[PathLike] = None) -> str:
    """In words, where :func:`load_config` would take the configuration from for
    ``path`` (for the log line that says which configuration a job runs with)."""
    cfg_path, origin = resolve_config_path(path)
    if origin == "env":
        return f"{cfg_path} (from ${ENV_CONFIG})"
    if origin == "default":
        return f"{cfg_path} (the site config)"
    if path is not None and Path(os.fspath(path)) == user_config_path():
        return f"{cfg_path} (your own config)"
    return f"{cfg_path} (given)"


def _read_file(path: Path) -> bytes:
    """The file's bytes: opened non-blocking and checked to be a regular file before it
    is read (a FIFO named as the config must not hang a root command), at most 16 MiB."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        chunks = []
        total = 0
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                return b"".join(chunks)
            total += len(b)
            if total > 16 * 2**20:
                raise OSError(errno.EFBIG, "larger than 16 MiB")
            chunks.append(b)
    finally:
        os.close(fd)


def load_config(path: Optional[PathLike] = None) -> Config:
    """Read and validate the site configuration; raise one-line :class:`ConfigError`."""
    cfg_path, origin = resolve_config_path(path)
    try:
        raw = _read_file(cfg_path)
    except FileNotFoundError:
        if origin == "default":
            raise ConfigError(
                f"no config: {cfg_path} not found (set {ENV_CONFIG} or pass --config)"
            ) from None
        if origin == "env":
            raise ConfigError(f"no config: {cfg_path} not found (from {ENV_CONFIG})") from None
        raise ConfigError(f"no config: {cfg_path} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"cannot read config {cfg_path}: is a directory") from None
    except PermissionError:
        raise ConfigError(f"cannot read config {cfg_path}: permission denied") from None
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        raise ConfigError(f"cannot read config {cfg_path}: {reason}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{cfg_path}: not UTF-8 text (bad byte at offset {exc.start})") from None
    try:
        data = _toml.loads(text)
    except _toml.TOMLDecodeError as exc:
        raise ConfigError(f"{cfg_path}: TOML syntax error: {exc}") from None
    return _build(data, str(cfg_path))


# --------------------------------------------------------------------------- validation


def _overlap(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def _build(data: Mapping[str, Any], src: str) -> Config:
    problems: List[str] = []
    if not isinstance(data, Mapping):
        raise ConfigError(f"{src}: expected a table at the top level")
    for key in data:
        if key not in TOP_KEYS:
            problems.append(unknown_key(src, "", str(key), TOP_KEYS, all_keys()))

    # [tiers]
    tiers_raw = data.get("tiers")
    tiers_objs, shared, kinds = parse_tiers(tiers_raw, src, problems)

    # Optional sections.
    sections: Dict[str, Any] = {}
    for name, cls in SECTION_CLASSES.items():
        raw = data.get(name)
        if raw is None:
            raw = {}
        extra: Dict[str, Any] = {}
        if name == "ledger":
            local = tiers_objs.get("local")
            if local is None:
                # The default depends on the local root; without one only check the keys.
                if isinstance(raw, Mapping) and "dir" not in raw:
                    extra["dir"] = Path("/")
            else:
                extra["dir"] = local.root / LEDGER_SUBDIR
        sections[name] = parse_section(cls, raw, src, name, problems, extra)

    # Cross-field checks.
    roots = [
        (f"tiers.{n}.root", tiers_objs[n].root)
        for n in ("local", PFS, "cold")
        if tiers_objs.get(n) is not None
    ]
    for i, (ka, ra) in enumerate(roots):
        for kb, rb in roots[i + 1 :]:
            if ra == rb:
                problems.append(f"{src}: {kb}: same directory as {ka} ({ra}); tiers must differ")
            elif _overlap(ra, rb):
                problems.append(
                    f"{src}: {kb}: {rb} and {ka} {ra} are nested; tiers must not overlap"
                )
    adm = sections.get("admission")
    if adm is not None and adm.lease <= adm.poll:
        problems.append(
            f"{src}: admission.lease: must be longer than admission.poll "
            f"({adm.lease:g}s <= {adm.poll:g}s); a holder renews its slot while it flushes"
        )
    if adm is not None and adm.dir is not None:
        for key, root in roots:
            if key != "tiers.pfs.root" and _overlap(adm.dir, root):
                problems.append(f"{src}: admission.dir: {adm.dir} overlaps {key} {root}")
    if (
        adm is not None
        and adm.enabled
        and adm.dir is None
        and tiers_objs.get(PFS) is None
        and tiers_objs.get(OBJECT_SECTION) is not None
    ):
        problems.append(
            f"{src}: admission.dir: a site without a PFS keeps its admission slots in a "
            "shared directory (an object store has no locks): set admission.dir, or drop "
            "admission.max_nodes/max_bandwidth"
        )
    job = sections.get("job")
    if job is not None and job.interval == "auto" and job.interval_seconds is not None:
        problems.append(f'{src}: job.interval: "auto" and job.interval_seconds exclude each other')

    if problems:
        raise ConfigError("; ".join(problems))
    tiers = TiersConfig(
        local=tiers_objs["local"],
        pfs=tiers_objs.get(PFS),
        object=tiers_objs.get(OBJECT_SECTION),
        cold=tiers_objs.get("cold"),
        shared=shared,
        kinds=kinds,
    )
    cfg = Config(tiers=tiers, source=src, **sections)
    # The process reads manifests with the limits of the configuration it loaded
    # (the parser has no config of its own: core.manifest_limits).
    m = cfg.manifests
    set_limits(ManifestLimits(m.max_bytes, m.max_depth, m.max_entries))
    return cfg
