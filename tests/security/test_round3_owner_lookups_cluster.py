"""Issue 28's epilog budget on a real SLURM (the dev cluster's slurmctld, 22.05): 5,000
held leftovers of one user naming 5,000 nodes that do not exist, then the real epilog
(as root, the real :class:`~slurm_ckpt.slurm.client.SlurmClient` asking the real
controller) for another user's job on n1. The victim's checkpoint is flushed within the
budget and SLURM's record of n1 carries no drain. The same with the ghosts due for a
retry: their names are asked about in one query, unknown to SLURM, so not live owners.

tests/security/test_round3_owner_lookups.py runs the same cases against a recording
stand-in that also counts every query and the names it carried.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import pytest

from slurm_ckpt.hooks.epilog import run_epilog
from slurm_ckpt.slurm.client import SlurmClient
from slurm_ckpt.tiers.registry import tiers_from_config

from .conftest import NODE, VICTIM, Site, save, steps
from .test_round3_owner_lookups import BUDGET, COUNT, _held_by_the_stager, _site_with_ghosts

if TYPE_CHECKING:
    from helpers.cluster import DevCluster

pytestmark = [pytest.mark.root, pytest.mark.cluster]


@pytest.fixture
def real_slurm(slurm_cluster: DevCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The real client, talking to the dev cluster's controller (its environment: the
    SLURM_CONF and PATH the cluster's own commands use); n1 resumed afterwards should
    anything have drained it, so that no later test inherits a drain."""
    for k in ("SLURM_CONF", "PATH"):
        monkeypatch.setenv(k, slurm_cluster.env[k])
    yield slurm_cluster
    if "DRAIN" in slurm_cluster.node_info(NODE).get("State", ""):
        slurm_cluster.run(["scontrol", "update", f"nodename={NODE}", "state=resume"], check=False)


def _not_drained(c: DevCluster) -> str:
    out = c.run(["scontrol", "-o", "show", "node", NODE]).stdout
    state = next(t for t in out.split() if t.startswith("State="))
    assert "DRAIN" not in state, out
    return state


@pytest.mark.parametrize("backoff", ["60s", "1ms"], ids=["held", "due_for_retry"])
def test_real_slurm_five_thousand_ghost_owners_never_stop_a_victims_flush(
    site: Site, real_slurm: Any, no_hang: Callable[[int], None], backoff: str
) -> None:
    cfg = _site_with_ghosts(site, retry_backoff=backoff)
    _held_by_the_stager(cfg)
    no_hang(600)
    save(cfg, VICTIM, "good", 1, job="200")
    t0 = time.monotonic()
    rep = run_epilog(cfg, site.env(VICTIM, job="200"), SlurmClient(backend="cli", timeout=30))
    took = time.monotonic() - t0
    assert steps(cfg, "pfs", VICTIM, "good") == [1], rep.line()
    assert tiers_from_config(cfg)["pfs"].verify(VICTIM, "good", 1).ok
    assert rep.drained is None and rep.backlog == (0, 0), rep.line()
    assert took <= BUDGET, f"{took:.1f}s: {rep.line()}"
    assert rep.owners is not None and rep.owners.queries <= 1, rep.owners
    if backoff == "1ms":
        assert rep.owners.unknown == COUNT, rep.owners
    state = _not_drained(real_slurm)
    print(f"\n[epilog, real SLURM, {backoff}] {took:.2f}s: {rep.line()}; node {state}")
