"""Round 2, finding 5: a hostile manifest cannot stop root.

A manifest's checksum proves integrity, not good intent: the attacker computes it over
whatever bytes they like. A ``meta`` nested 100,000 levels deep once made ``json.loads``
raise ``RecursionError`` in root's ``ckpt-slurm status``, which exited 1 with a
traceback and showed nobody. The depth, size and entry limits (``[manifests]`` in the
config) are now checked on the bytes before any parse, and what still escapes a parser
is damage of that one series.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import xxhash

from slurm_ckpt.core.config import Config
from slurm_ckpt.core.manifest import Manifest, manifest_facts
from slurm_ckpt.errors import VerifyError

from .conftest import ATTACKER, VICTIM, Site, as_user, cli, forged_manifest, plant_checkpoint, save

DATA = b"z" * 64
_CHECKSUM = re.compile(rb'\A\{\n "checksum": "[0-9a-f]{32}",\n')


def with_meta(user: str, key: str, step: int, meta: bytes) -> bytes:
    """A manifest whose ``meta`` is the raw JSON ``meta`` and whose checksum line
    matches the rest of the bytes, as an attacker writes it (not canonical: no
    serialiser would write 100,000 levels, but the checksum still verifies)."""
    good = forged_manifest(user, key, step, DATA)
    m = _CHECKSUM.match(good)
    assert m is not None
    rest = good[m.end() :]
    assert b'"meta": {}' in rest
    rest = rest.replace(b'"meta": {}', b'"meta": ' + meta)
    digest = xxhash.xxh3_128_hexdigest(b"{\n" + rest)
    return b'{\n "checksum": "' + digest.encode() + b'",\n' + rest


def deep(levels: int) -> bytes:
    return b'{"x": ' + b"[" * levels + b"]" * levels + b"}"


def test_deep_and_huge_manifests_are_refused_in_process() -> None:
    """Before any parse: the refusal names the limit, not a parser's failure."""
    bomb = with_meta(ATTACKER, "bomb", 1, deep(100_000))
    for parse in (Manifest.from_bytes, manifest_facts):
        with pytest.raises(VerifyError, match="nested deeper"):
            parse(bomb)
    huge = with_meta(ATTACKER, "huge", 1, b'{"x": "' + b"a" * (17 * 2**20) + b'"}')
    for parse in (Manifest.from_bytes, manifest_facts):
        with pytest.raises(VerifyError, match="larger than"):
            parse(huge)
    # A legitimate nesting (the meta limit is 32 levels) still reads.
    ok = with_meta(VICTIM, "ok", 1, deep(20))
    assert manifest_facts(ok).step == 1


def test_entry_limit_comes_from_the_config(site: Site) -> None:
    files = [{"path": f"f{i}", "size": 0, "hash": "0" * 32, "chunks": []} for i in range(101)]
    many = forged_manifest(ATTACKER, "many", 1, DATA, files=files)
    Config.from_dict(site.data(manifests={"max_entries": 100}))
    try:
        for parse in (Manifest.from_bytes, manifest_facts):
            with pytest.raises(VerifyError, match="entries"):
                parse(many)
    finally:
        Config.from_dict(site.data())  # back to the defaults for this process


def _plant(pfs: str) -> None:
    plant_checkpoint(pfs, ATTACKER, "bomb", 1, DATA, with_meta(ATTACKER, "bomb", 1, deep(100_000)))
    huge = with_meta(ATTACKER, "huge", 1, b'{"x": "' + b"a" * (17 * 2**20) + b'"}')
    plant_checkpoint(pfs, ATTACKER, "huge", 1, DATA, huge)


def test_deep_manifest_does_not_stop_roots_status_for_everyone(site: Site) -> None:
    cfg = site.cfg()
    conf = site.config_file()
    save(cfg, VICTIM, "run", 1, job="7")

    def flush() -> None:
        from slurm_ckpt.tiers.copy import copy_checkpoint
        from slurm_ckpt.tiers.registry import tiers_from_config

        t = tiers_from_config(cfg)
        copy_checkpoint(t["local"], t["pfs"], VICTIM, "run", 1)

    as_user(VICTIM, flush)
    as_user(ATTACKER, _plant, str(site.pfs))
    r = cli("status", "--json", "--no-slurm", config=conf)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    jobs: Any = json.loads(r.stdout)["jobs"]
    assert any(j["user"] == VICTIM and "run" in j["keys"] for j in jobs), jobs
    r = cli("status", "--no-slurm", config=conf)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert VICTIM in r.stdout
    r = cli("list", "--json", config=conf)
    assert "Traceback" not in r.stderr and VICTIM in r.stdout, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    rows = rows if isinstance(rows, list) else rows.get("series", rows)
    text = json.dumps(rows)
    assert "bomb" in text and "huge" in text  # listed, as damaged, not fatal
    for key in ("bomb", "huge"):
        r = cli("list", key, "-u", ATTACKER, config=conf)
        assert "Traceback" not in r.stderr and r.returncode == 1, (key, r.stderr[-2000:])
        assert "CORRUPT" in r.stdout, r.stdout
    r = cli("gc", "--dry-run", "--json", config=conf)
    assert "Traceback" not in r.stderr and r.returncode in (0, 1), r.stderr[-2000:]


def test_a_writer_hears_at_commit_that_its_manifest_is_over_the_limits(tmp_path: Any) -> None:
    """The limits bind the writer too: a checkpoint root would refuse as damage is not
    committed (and nothing of it is left listable)."""
    from slurm_ckpt.core.names import current_user
    from slurm_ckpt.tiers.registry import tiers_from_config

    (tmp_path / "l").mkdir()
    (tmp_path / "p").mkdir()
    cfg = Config.standalone(tmp_path / "l", tmp_path / "p", manifests={"max_entries": 2})
    try:
        local = tiers_from_config(cfg)["local"]
        me = current_user()
        w = local.writer(me, "big", 1)
        w.write_buffers({f"f{i}.bin": b"x" for i in range(3)})
        with pytest.raises(VerifyError, match="more than 2 entries"):
            w.commit()
        assert [s.step for s in local.steps(me, "big")] == []
    finally:
        Config.standalone(tmp_path / "l", tmp_path / "p")  # the defaults again
