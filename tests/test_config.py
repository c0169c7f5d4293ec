"""Site configuration: parsing, defaults, validation messages, overrides."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from slurm_ckpt.core import config as config_mod
from slurm_ckpt.core.config import (
    Config,
    CopyConfig,
    LocalTierConfig,
    RetentionConfig,
    load_config,
    resolve_config_path,
)
from slurm_ckpt.errors import CkptError, ConfigError

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "etc" / "config.toml"
NOBODY = 65534

MINIMAL = """
[tiers.local]
root = "/local/ckpt"
[tiers.pfs]
root = "/pfs/ckpt"
"""

FULL = """
[tiers.local]
root = "/local/ckpt/"
require_mount = false
min_free = "5GiB"

[tiers.pfs]
root = "/pfs/ckpt"
bandwidth_limit = "500MB/s"

[tiers.object]
endpoint = "https://s3.example.org"
bucket = "ckpt"
prefix = "site/a"

[tiers.cold]
root = "/archive/ckpt"

[retention]
keep_local = 4
flush_every = 2
keep_warm = 5
keep_warm_every = "12h"

[copy]
streams = 8
chunk_size = "128MiB"
buffer_size = 1048576

[job]
interval_tokens = 2_000_000_000
interval_steps = 500
interval_seconds = "30min"
mtbi = "2d"
signals = ["TERM", "sigusr1", "SIGTERM"]
max_consecutive_failures = 5
staging_memory_limit = "32GiB"

[hooks]
budget = "90s"
expected_checkpoint_size = "200GB"
stage_on_requeue = true

[ledger]
dir = "/var/lib/slurm-ckpt/ledger"

[metrics]
textfile_dir = "/var/lib/node_exporter"
events_dir = "/var/log/slurm-ckpt"
"""


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(config_mod.ENV_CONFIG, raising=False)


def write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(path_or_text, tmp_path: Path | None = None) -> str:
    """Load a file (or text written to one) and return the ConfigError message."""
    if tmp_path is not None:
        path_or_text = write(tmp_path, path_or_text)
    with pytest.raises(ConfigError) as info:
        load_config(path_or_text)
    msg = str(info.value)
    assert "\n" not in msg
    assert info.value.exit_code == 2
    return msg


# --------------------------------------------------------------------------- valid files


def test_minimal_config_has_documented_defaults(tmp_path):
    path = write(tmp_path, MINIMAL)
    cfg = load_config(path)
    assert cfg.source == str(path)
    assert cfg.tiers.local == LocalTierConfig(
        root=Path("/local/ckpt"), require_mount=True, min_free=10 * 2**30
    )
    assert cfg.tiers.pfs.root == Path("/pfs/ckpt")
    assert cfg.tiers.pfs.bandwidth_limit is None
    assert cfg.tiers.object is None and cfg.tiers.cold is None
    assert cfg.retention == RetentionConfig(
        keep_local=2, flush_every=1, keep_warm=3, keep_warm_every=86400.0
    )
    assert cfg.copy == CopyConfig(streams=4, chunk_size=64 * 2**20, buffer_size=16 * 2**20)
    assert cfg.job.signals == ("SIGTERM", "SIGUSR1", "SIGUSR2")
    assert cfg.job.interval is None and cfg.job.interval_seconds is None
    assert cfg.job.mtbi == 86400.0
    assert cfg.job.max_consecutive_failures == 3
    assert cfg.job.staging_memory_limit == 0
    assert cfg.hooks.budget == 100.0
    assert cfg.hooks.expected_checkpoint_size is None
    assert cfg.hooks.stage_on_requeue is False
    assert cfg.ledger.dir == Path("/local/ckpt/.slurm_ckpt") == cfg.ledger_dir
    assert cfg.metrics.textfile_dir is None and cfg.metrics.events_dir is None


def test_full_config_values_and_round_trip(tmp_path):
    cfg = load_config(write(tmp_path, FULL))
    assert cfg.tiers.local.root == Path("/local/ckpt")  # normalised
    assert cfg.tiers.local.require_mount is False
    assert cfg.tiers.local.min_free == 5 * 2**30
    assert cfg.tiers.pfs.bandwidth_limit == 500e6
    assert cfg.tiers.object is not None and cfg.tiers.object.prefix == "site/a"
    assert cfg.tiers.cold is not None and cfg.tiers.cold.root == Path("/archive/ckpt")
    assert (cfg.retention.keep_local, cfg.retention.flush_every) == (4, 2)
    assert cfg.retention.keep_warm_every == 12 * 3600
    assert cfg.copy == CopyConfig(streams=8, chunk_size=128 * 2**20, buffer_size=2**20)
    assert cfg.job.interval_tokens == 2_000_000_000
    assert cfg.job.interval_seconds == 1800.0
    assert cfg.job.mtbi == 2 * 86400
    assert cfg.job.signals == ("SIGTERM", "SIGUSR1")  # normalised, deduplicated
    assert cfg.job.staging_memory_limit == 32 * 2**30
    assert cfg.hooks.expected_checkpoint_size == 200 * 10**9
    assert cfg.hooks.stage_on_requeue is True
    assert cfg.ledger.dir == Path("/var/lib/slurm-ckpt/ledger")
    assert cfg.metrics.events_dir == Path("/var/log/slurm-ckpt")

    data = cfg.to_dict()
    assert data["tiers"]["local"]["root"] == "/local/ckpt"
    assert data["copy"]["chunk_size"] == 128 * 2**20
    # JSON round trip gives back an equal config.
    again = Config.from_dict(json.loads(json.dumps(data)))
    assert again == cfg
    assert again.to_dict() == data
    human = cfg.to_dict(human=True)
    assert human["copy"]["chunk_size"] == "128.0MiB"
    assert human["retention"]["keep_warm_every"] == "12h00m"


def test_config_is_frozen(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.copy.streams = 9  # type: ignore[misc]
    hash(cfg)


def test_interval_auto_and_zero_bandwidth(tmp_path):
    text = MINIMAL.replace('root = "/pfs/ckpt"', 'root = "/pfs/ckpt"\nbandwidth_limit = 0')
    cfg = load_config(write(tmp_path, text + '[job]\ninterval = "auto"\n'))
    assert cfg.job.interval == "auto"
    assert cfg.tiers.pfs.bandwidth_limit is None


def test_example_config_is_valid_and_shows_defaults():
    cfg = load_config(EXAMPLE)
    defaults = Config.standalone("/local/scratch/slurm-ckpt", "/lustre/checkpoints")
    # Every uncommented value in the example is the default (apart from the tier roots and
    # the require_mount/min_free that standalone relaxes).
    assert cfg.retention == defaults.retention
    assert cfg.copy == defaults.copy
    assert cfg.job == defaults.job
    assert cfg.hooks == defaults.hooks
    assert cfg.metrics == defaults.metrics
    assert cfg.ledger == defaults.ledger
    assert cfg.tiers.local.require_mount is True
    assert cfg.tiers.local.min_free == 10 * 2**30


def test_example_config_mentions_every_key():
    text = EXAMPLE.read_text()
    classes = [*config_mod.TIER_CLASSES.values(), *config_mod.SECTION_CLASSES.values()]
    for cls in classes:
        for f in dataclasses.fields(cls):
            assert re.search(rf"^#? ?{f.name} = ", text, re.M), f"{cls.__name__}.{f.name}"


def test_example_config_with_optional_lines_uncommented(tmp_path):
    lines = []
    for line in EXAMPLE.read_text().splitlines():
        m = re.match(r"^# (\[[a-z.]+\]|[a-z_]+ = .*)$", line)
        if m and not line.startswith("# interval = "):
            line = m.group(1)
        lines.append(line)
    cfg = load_config(write(tmp_path, "\n".join(lines) + "\n"))
    assert cfg.tiers.object is not None and cfg.tiers.object.bucket == "ml-checkpoints"
    assert cfg.tiers.cold is not None
    assert cfg.tiers.pfs.bandwidth_limit == 500e6
    assert cfg.job.interval_steps == 1000
    assert cfg.hooks.expected_checkpoint_size == 200 * 2**30
    assert cfg.metrics.textfile_dir is not None


# --------------------------------------------------------------------------- bad input


def test_unknown_key_suggests_close_match(tmp_path):
    msg = error_of(MINIMAL + "[copy]\nstreems = 4\n", tmp_path)
    path = tmp_path / "config.toml"
    assert msg == f"{path}: unknown key 'copy.streems' (did you mean 'copy.streams'?)"


def test_unknown_key_in_wrong_section_and_unknown_section(tmp_path):
    msg = error_of(MINIMAL + "[retention]\nstreams = 4\n[jobs]\nx = 1\n", tmp_path)
    assert "unknown key 'retention.streams' (did you mean 'copy.streams'?)" in msg
    assert "unknown section 'jobs' (did you mean 'job'?)" in msg


def test_unknown_tier(tmp_path):
    msg = error_of(MINIMAL + "[tiers.s3]\nbucket = 'x'\n", tmp_path)
    assert "unknown key 'tiers.s3'" in msg


def test_unknown_key_without_suggestion(tmp_path):
    msg = error_of(MINIMAL + "[hooks]\nzzz = 1\n", tmp_path)
    assert msg.endswith("unknown key 'hooks.zzz'")


def test_missing_tiers(tmp_path):
    path = write(tmp_path, "[tiers.local]\nroot = '/l'\n")
    assert error_of(path) == (
        f"{path}: [tiers.pfs] is missing (required) (or [tiers.object] for a site without one)"
    )
    msg = error_of("[copy]\nstreams = 2\n", tmp_path)
    assert "[tiers.local] is missing (required)" in msg
    assert "[tiers.pfs] is missing (required)" in msg
    msg = error_of("[tiers.local]\nmin_free = 0\n[tiers.pfs]\nroot = '/p'\n", tmp_path)
    assert msg.endswith("tiers.local.root is missing (required)")
    msg = error_of(MINIMAL + "[tiers.object]\nbucket = 'b'\n", tmp_path)
    assert "tiers.object.endpoint is missing (required)" in msg


def test_relative_path(tmp_path):
    path = write(tmp_path, MINIMAL.replace('"/pfs/ckpt"', '"pfs/ckpt"'))
    assert error_of(path) == (f"{path}: tiers.pfs.root: must be an absolute path, got 'pfs/ckpt'")
    msg = error_of(MINIMAL + "[metrics]\nevents_dir = '~/events'\n", tmp_path)
    assert "metrics.events_dir: must be an absolute path" in msg


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ("[copy]\nstreams = 'four'", "copy.streams: expected an integer, got a string 'four'"),
        ("[copy]\nstreams = 0", "copy.streams: must be at least 1, got 0"),
        ("[copy]\nchunk_size = 'big'", "copy.chunk_size: expected a size such as 64MiB"),
        ("[copy]\nchunk_size = [1]", "copy.chunk_size: expected a number or a string"),
        ("[retention]\nkeep_local = true", "retention.keep_local: expected an integer"),
        ("[retention]\nkeep_warm_every = 'soon'", "retention.keep_warm_every: expected a dur"),
        ("[job]\nsignals = 'SIGTERM'", "job.signals: expected an array of signal names"),
        ("[job]\nsignals = ['SIGNOPE']", "job.signals: unknown signal 'SIGNOPE'"),
        ("[job]\nsignals = ['SIGKILL']", "job.signals: SIGKILL cannot be caught"),
        ("[job]\nsignals = [15]", "job.signals: expected signal names"),
        ("[job]\ninterval = '6h'", 'job.interval: expected "auto" or no value'),
        ("[job]\nmtbi = 0", "job.mtbi: must be positive"),
        ("[job]\ninterval = 'auto'\ninterval_seconds = 60", "exclude each other"),
        ("[hooks]\nstage_on_requeue = 'yes'", "hooks.stage_on_requeue: expected true or"),
        ("[hooks]\nbudget = -5", "hooks.budget: must not be negative"),
        ("retention = 3", "retention: expected a table [retention], got an integer"),
        ("[ledger]\ndir = 5", "ledger.dir: expected a path string, got an integer"),
    ],
)
def test_wrong_types(tmp_path, snippet, expected):
    # A top-level key must come before the first table header.
    text = MINIMAL + snippet if snippet.startswith("[") else snippet + "\n" + MINIMAL
    msg = error_of(text + "\n", tmp_path)
    assert expected in msg
    assert msg.startswith(f"{tmp_path / 'config.toml'}: ")


def test_wrong_types_in_tiers(tmp_path):
    text = """
tiers = 3
"""
    assert "tiers: expected a table" in error_of(text, tmp_path)
    text = MINIMAL.replace('root = "/local/ckpt"', 'root = "/local/ckpt"\nrequire_mount = 1')
    assert "tiers.local.require_mount: expected true or false" in error_of(text, tmp_path)
    text = MINIMAL + "[tiers.object]\nendpoint = 's3.example.org'\nbucket = 'b'\n"
    assert "tiers.object.endpoint: expected an http:// or https:// URL" in error_of(text, tmp_path)
    text = MINIMAL + "[tiers.object]\nendpoint = 'http://s3'\nbucket = 'b'\nprefix = '../x'\n"
    assert "tiers.object.prefix: must be a relative key prefix" in error_of(text, tmp_path)


def test_overlapping_tiers(tmp_path):
    text = "[tiers.local]\nroot = '/data'\n[tiers.pfs]\nroot = '/data/'\n"
    assert "tiers.pfs.root: same directory as tiers.local.root" in error_of(text, tmp_path)
    text = "[tiers.local]\nroot = '/data/local'\n[tiers.pfs]\nroot = '/data'\n"
    assert "nested; tiers must not overlap" in error_of(text, tmp_path)


def test_all_problems_collected_on_one_line(tmp_path):
    text = """
[tiers.local]
root = "relative"
min_fre = "1GiB"
[copy]
streams = "x"
[bogus]
"""
    msg = error_of(text, tmp_path)
    parts = msg.split("; ")
    assert len(parts) == 5, parts
    assert all(p.startswith(str(tmp_path / "config.toml") + ": ") for p in parts)


def test_toml_syntax_error_names_line(tmp_path):
    path = write(tmp_path, "[tiers.local]\nroot = '/l'\nthis is not toml\n")
    msg = error_of(path)
    assert msg.startswith(f"{path}: TOML syntax error: ")
    assert "line 3" in msg


def test_not_utf8(tmp_path):
    path = tmp_path / "config.toml"
    path.write_bytes(b"[tiers.local]\nroot = '/l\xff'\n")
    assert "not UTF-8" in error_of(path)


def test_missing_explicit_file(tmp_path):
    path = tmp_path / "nope.toml"
    assert error_of(path) == f"no config: {path} not found"


def test_missing_default_file(monkeypatch, tmp_path):
    monkeypatch.setattr(config_mod, "DEFAULT_CONFIG_PATH", tmp_path / "absent.toml")
    msg = error_of(None)
    assert msg == (
        f"no config: {tmp_path / 'absent.toml'} not found (set SLURM_CKPT_CONFIG or pass --config)"
    )


@pytest.mark.skipif(
    os.path.exists("/etc/slurm-ckpt/config.toml"), reason="a real site config is installed"
)
def test_missing_real_default_file():
    assert error_of(None) == (
        "no config: /etc/slurm-ckpt/config.toml not found (set SLURM_CKPT_CONFIG or pass --config)"
    )


def test_directory_instead_of_file(tmp_path):
    assert error_of(tmp_path) == f"cannot read config {tmp_path}: is a directory"


def _load_as_nobody(path: Path) -> str:
    """Try to load ``path`` as an unprivileged user; return the error (or 'loaded')."""
    if os.geteuid() != 0:
        try:
            load_config(path)
        except ConfigError as exc:
            return str(exc)
        return "loaded"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop root, then try
        out = "loaded"
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            load_config(path)
        except ConfigError as exc:
            out = str(exc)
        except BaseException as exc:  # noqa: BLE001 - report anything to the parent
            out = f"unexpected {type(exc).__name__}: {exc}"
        finally:
            os.write(w, out.encode())
            os._exit(0)
    os.close(w)
    with io.FileIO(r, "r") as fh:
        data = fh.readall().decode()
    os.waitpid(pid, 0)
    return data


def test_unreadable_file():
    tmp = Path(tempfile.mkdtemp(prefix="ckpt-cfg-"))
    try:
        tmp.chmod(0o755)
        path = tmp / "config.toml"
        path.write_text(MINIMAL)
        path.chmod(0o000)
        assert _load_as_nobody(path) == f"cannot read config {path}: permission denied"
        path.chmod(0o644)
        assert _load_as_nobody(path) == "loaded"
    finally:
        shutil.rmtree(tmp)


# --------------------------------------------------------------------------- file selection


def test_env_override(monkeypatch, tmp_path):
    env_file = write(tmp_path, MINIMAL, "env.toml")
    monkeypatch.setenv("SLURM_CKPT_CONFIG", str(env_file))
    assert resolve_config_path() == (env_file, "env")
    assert load_config().source == str(env_file)
    assert Config.load().tiers.pfs.root == Path("/pfs/ckpt")

    explicit = write(tmp_path, MINIMAL.replace("/pfs/ckpt", "/pfs/other"), "explicit.toml")
    assert load_config(explicit).tiers.pfs.root == Path("/pfs/other")

    monkeypatch.setenv("SLURM_CKPT_CONFIG", str(tmp_path / "gone.toml"))
    assert error_of(None) == (
        f"no config: {tmp_path / 'gone.toml'} not found (from SLURM_CKPT_CONFIG)"
    )

    monkeypatch.setenv("SLURM_CKPT_CONFIG", "")
    assert resolve_config_path() == (config_mod.DEFAULT_CONFIG_PATH, "default")


# --------------------------------------------------------------------------- standalone


def test_standalone_without_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = Config.standalone("local", tmp_path / "pfs")
    assert cfg.source == "<standalone>"
    assert cfg.tiers.local.root == tmp_path / "local"
    assert cfg.tiers.pfs.root == tmp_path / "pfs"
    assert cfg.tiers.local.require_mount is False
    assert cfg.tiers.local.min_free == 0
    assert cfg.ledger.dir == tmp_path / "local" / ".slurm_ckpt"
    assert cfg.retention == RetentionConfig()


def test_standalone_overrides(tmp_path):
    cfg = Config.standalone(
        tmp_path / "l",
        tmp_path / "p",
        retention={"keep_local": 5},
        copy=CopyConfig(streams=8),
        job={"interval_seconds": "10min", "signals": ["USR1"]},
        tiers={"local": {"min_free": "1GiB"}, "cold": {"root": str(tmp_path / "cold")}},
    )
    assert cfg.retention.keep_local == 5 and cfg.retention.keep_warm == 3
    assert cfg.copy.streams == 8
    assert cfg.job.interval_seconds == 600.0 and cfg.job.signals == ("SIGUSR1",)
    assert cfg.tiers.local.min_free == 2**30
    assert cfg.tiers.local.root == tmp_path / "l"  # merged, not replaced
    assert cfg.tiers.cold is not None and cfg.tiers.cold.root == tmp_path / "cold"
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_standalone_rejects_bad_overrides(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"<standalone>: unknown section 'retenion' "
        r"\(did you mean 'retention'\?\)",
    ):
        Config.standalone(tmp_path / "l", tmp_path / "p", retenion={"keep_local": 1})
    with pytest.raises(ConfigError, match=r"<standalone>: copy.streams: must be at least 1"):
        Config.standalone(tmp_path / "l", tmp_path / "p", copy={"streams": 0})
    with pytest.raises(ConfigError, match="same directory"):
        Config.standalone(tmp_path, tmp_path)


def test_config_error_is_ckpt_error():
    assert issubclass(ConfigError, CkptError)


# --------------------------------------------------------------------------- tier kinds

NEW_FORM = """
[tiers]
shared = ["pfs", "object", "cold"]
[tiers.local]
root = "/local/ckpt"
[tiers.pfs]
kind = "posix"
root = "/pfs/ckpt"
[tiers.object]
kind = "s3"
endpoint = "http://127.0.0.1:8333"
bucket = "ckpt"
[tiers.cold]
kind = "posix"
root = "/archive/ckpt"
"""


def test_tiers_say_their_kind_and_the_shared_list_orders_them(tmp_path, recwarn):
    cfg = load_config(write(tmp_path, NEW_FORM))
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]
    assert cfg.tiers.shared_tiers == ("pfs", "object", "cold") and cfg.tiers.warm == "pfs"
    assert [cfg.tiers.kind_of(n) for n in ("local", "pfs", "object", "cold")] == [
        "posix",
        "posix",
        "s3",
        "posix",
    ]
    shown = cfg.to_dict()["tiers"]
    assert shown["shared"] == ["pfs", "object", "cold"] and shown["object"]["kind"] == "s3"
    assert Config.from_dict(cfg.to_dict()) == cfg  # the current form round-trips


def test_every_old_tiers_form_still_loads_with_a_warning_naming_the_new_form(tmp_path):
    old = re.sub(r"^(kind = .*|shared = .*|\[tiers\])\n", "", NEW_FORM, flags=re.M)
    assert "kind" not in old and "shared" not in old
    with pytest.warns(DeprecationWarning) as got:
        cfg = load_config(write(tmp_path, old))
    msg = str(got[0].message)
    assert "without kind are deprecated" in msg
    assert 'shared = ["pfs", "object", "cold"]' in msg and 'kind = "s3" in [tiers.object]' in msg
    assert cfg == load_config(write(tmp_path, NEW_FORM))  # the very same configuration
    no_pfs = re.sub(r'\[tiers\.(pfs|cold)\]\nroot = ".*"\n', "", old)
    with pytest.warns(DeprecationWarning, match=r'shared = \["object"\] and kind = "s3"'):
        assert load_config(write(tmp_path, no_pfs)).tiers.warm == "object"
    with pytest.warns(DeprecationWarning, match=r'shared = \["pfs"\] and kind = "posix"'):
        load_config(write(tmp_path, MINIMAL))
    assert load_config(EXAMPLE).tiers.warm == "pfs"


def test_config_check_tells_the_admin_the_new_form(tmp_path):
    """Python hides DeprecationWarnings from a command line: ``config check`` is where an
    admin runs into them, so it prints each as one warning line (and still says ok)."""
    from helpers.cli import ckpt_slurm

    r = ckpt_slurm("config", "check", "--offline", config=write(tmp_path, MINIMAL))
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "deprecated" in ln]
    assert len(lines) == 1 and lines[0].startswith("warning: deprecated: "), r.stderr
    assert 'shared = ["pfs"] and kind = "posix"' in lines[0]
    r = ckpt_slurm("config", "check", "--offline", config=write(tmp_path, NEW_FORM))
    assert r.returncode == 0 and "deprecated" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    "change, message",
    [
        ('kind = "S3!"\nroot = "/pfs', 'tiers.pfs.kind: expected a kind name such as "posix"'),
        ('kind = 3\nroot = "/pfs', 'tiers.pfs.kind: expected a kind name such as "posix"'),
    ],
)
def test_a_wrong_kind_is_one_line(tmp_path, change, message):
    msg = error_of(NEW_FORM.replace('kind = "posix"\nroot = "/pfs', change), tmp_path)
    assert message in msg and "\n" not in msg


@pytest.mark.parametrize(
    "shared, message",
    [
        ('["object", "pfs", "cold"]', "is not an order this release supports"),
        ('["pfs", "object"]', 'list every configured shared tier once: ["pfs", "object", "cold"]'),
        ('["pfs", "pfs", "object", "cold"]', "list every configured shared tier once"),
        ('["pfs", "gcs"]', "'gcs' is not a shared tier (one of: pfs, object, cold)"),
        ('"pfs"', "tiers.shared: expected a list of tier names"),
    ],
)
def test_a_wrong_shared_list_is_one_line(tmp_path, shared, message):
    msg = error_of(NEW_FORM.replace('["pfs", "object", "cold"]', shared), tmp_path)
    assert message in msg and "\n" not in msg


def test_shared_names_a_tier_without_a_section(tmp_path):
    text = NEW_FORM.split("[tiers.cold]")[0]
    msg = error_of(text, tmp_path)
    assert "tiers.shared: 'cold' has no [tiers.cold] section" in msg
