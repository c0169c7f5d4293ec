"""Retention policy: flush selection and per-tier deletion plans (pure functions)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_ckpt.core.retention import (
    CkptInfo,
    RetentionPolicy,
    needs_flush,
    plan_local_deletions,
    plan_warm_deletions,
    selected_for_flush,
)
from slurm_ckpt.errors import CkptError, ConfigError

DAY = 86400.0


def local(step, *, seq=None, sel=True, forced=False, pinned=False, pfs=False, t=None):
    return CkptInfo(
        step=step,
        wall_time=float(step) if t is None else t,
        seq=step if seq is None else seq,
        nbytes=100,
        selected_for_flush=sel,
        forced=forced,
        pinned=pinned,
        verified=True,
        warm_verified=pfs,
    )


def pfs(step, t, *, verified=True, pinned=False, nxt=None):
    return CkptInfo(
        step=step,
        wall_time=t,
        nbytes=100,
        verified=verified,
        pinned=pinned,
        next_tier_verified=nxt,
    )


# -- policy -------------------------------------------------------------------------------


def test_policy_defaults():
    p = RetentionPolicy()
    assert (p.keep_local, p.flush_every, p.keep_warm, p.keep_warm_every_s) == (2, 1, 3, DAY)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep_local": -1},
        {"flush_every": 0},
        {"flush_every": -3},
        {"keep_warm": -1},
        {"keep_warm_every_s": -1.0},
        {"keep_warm_every_s": float("nan")},
        {"keep_local": 1.5},
        {"keep_local": True},
        {"flush_every": "2"},
        {"keep_warm_every_s": "1d"},
    ],
)
def test_policy_rejects_bad_values(kwargs):
    with pytest.raises(ConfigError) as exc:
        RetentionPolicy(**kwargs)
    assert isinstance(exc.value, CkptError)
    assert "\n" not in str(exc.value)
    assert "retention." in str(exc.value)


def test_policy_accepts_edge_values():
    RetentionPolicy(keep_local=0, flush_every=1, keep_warm=0, keep_warm_every_s=0)
    RetentionPolicy(keep_warm_every_s=math.inf)
    RetentionPolicy(flush_every=10**9)


def test_policy_is_immutable():
    p = RetentionPolicy()
    with pytest.raises(AttributeError):
        p.keep_local = 5  # type: ignore[misc]


# -- flush selection ----------------------------------------------------------------------


def test_selected_for_flush_is_zero_based():
    p = RetentionPolicy(flush_every=3)
    assert [s for s in range(10) if selected_for_flush(s, p)] == [0, 3, 6, 9]


def test_selected_for_flush_every_one_selects_all():
    p = RetentionPolicy(flush_every=1)
    assert all(selected_for_flush(s, p) for s in range(50))


def test_selected_for_flush_default_policy_and_unknown_seq():
    assert selected_for_flush(7)
    assert selected_for_flush(-1, RetentionPolicy(flush_every=4))


def test_needs_flush_honours_forced():
    assert needs_flush(local(1, sel=True))
    assert needs_flush(local(1, sel=False, forced=True))
    assert not needs_flush(local(1, sel=False))


def test_ckptinfo_defaults_are_cautious():
    info = CkptInfo(step=5)
    assert info.selected_for_flush and not info.verified and not info.warm_verified
    # Default-built entries are never deleted from local (not flushed yet).
    assert plan_local_deletions([CkptInfo(step=s) for s in range(5)], RetentionPolicy(0)) == []


# -- local plan ---------------------------------------------------------------------------


def test_local_keeps_newest_and_deletes_flushed_older():
    infos = [local(s, pfs=True) for s in range(10, 60, 10)]
    assert plan_local_deletions(infos, RetentionPolicy(keep_local=2)) == [10, 20, 30]


def test_local_unflushed_selected_are_never_deleted():
    infos = [local(s, pfs=(s <= 20)) for s in range(10, 60, 10)]
    # 30 is selected and not yet on the PFS: kept even though superseded.
    assert plan_local_deletions(infos, RetentionPolicy(keep_local=2)) == [10, 20]


def test_local_not_selected_goes_once_superseded():
    infos = [local(s, sel=False) for s in range(1, 6)]
    assert plan_local_deletions(infos, RetentionPolicy(keep_local=2)) == [1, 2, 3]
    assert plan_local_deletions(infos, RetentionPolicy(keep_local=0)) == [1, 2, 3, 4, 5]


def test_local_forced_is_protected_until_verified():
    infos = [local(1, sel=False, forced=True), local(2, sel=False), local(3, sel=False)]
    assert plan_local_deletions(infos, RetentionPolicy(keep_local=1)) == [2]
    infos[0].warm_verified = True
    assert plan_local_deletions(infos, RetentionPolicy(keep_local=1)) == [1, 2]


def test_local_pinned_never_deleted():
    infos = [local(1, sel=False, pinned=True), local(2, sel=False), local(3, sel=False)]
    assert plan_local_deletions(infos, RetentionPolicy(keep_local=0)) == [2, 3]


def test_local_keep_zero_still_protects_pending_flush():
    infos = [local(s, pfs=False) for s in range(5)]
    assert plan_local_deletions(infos, RetentionPolicy(keep_local=0)) == []
    for i in infos:
        i.warm_verified = True
    assert plan_local_deletions(infos, RetentionPolicy(keep_local=0)) == [0, 1, 2, 3, 4]


def test_local_policy_flush_every_does_not_override_recorded_decision():
    # Saved when flush_every was 1 (all selected); the policy now says 1000. The recorded
    # decision wins: the stager was told to copy them.
    infos = [local(s, seq=s, sel=True) for s in range(1, 6)]
    assert plan_local_deletions(infos, RetentionPolicy(keep_local=0, flush_every=1000)) == []


def test_local_newest_is_by_step_not_time():
    # Clock went backwards: step 30 has an older wall time than step 20.
    infos = [local(10, sel=False, t=100), local(20, sel=False, t=300), local(30, sel=False, t=50)]
    assert plan_local_deletions(infos, RetentionPolicy(keep_local=1)) == [10, 20]


def test_local_empty_and_order_independent():
    assert plan_local_deletions([], RetentionPolicy()) == []
    infos = [local(s, sel=(s % 2 == 0), pfs=(s < 6)) for s in range(12)]
    expected = plan_local_deletions(infos, RetentionPolicy(keep_local=3))
    assert plan_local_deletions(list(reversed(infos)), RetentionPolicy(keep_local=3)) == expected


def test_local_duplicate_step_protected_if_any_entry_protected():
    infos = [local(1, sel=False), local(1, sel=True, pfs=False), local(2, sel=False)]
    assert plan_local_deletions(infos, RetentionPolicy(keep_local=0)) == [2]


def test_local_default_policy():
    infos = [local(s, pfs=True) for s in range(6)]
    assert plan_local_deletions(infos) == [0, 1, 2, 3]


# -- PFS plan -----------------------------------------------------------------------------


def test_pfs_keeps_newest_n_and_one_per_window():
    # Four checkpoints a day for 5 days, all verified.
    infos = [pfs(d * 4 + k, d * DAY + k * 6 * 3600.0) for d in range(5) for k in range(4)]
    now = 5 * DAY
    doomed = plan_warm_deletions(infos, now, RetentionPolicy(keep_warm=3, keep_warm_every_s=DAY))
    kept = sorted({i.step for i in infos} - set(doomed))
    # Oldest of each day (0, 4, 8, 12, 16) + newest three (17, 18, 19).
    assert kept == [0, 4, 8, 12, 16, 17, 18, 19]


def test_pfs_windows_disabled():
    infos = [pfs(s, s * 1000.0) for s in range(10)]
    doomed = plan_warm_deletions(infos, 1e6, RetentionPolicy(keep_warm=2, keep_warm_every_s=0))
    assert doomed == list(range(8))


def test_pfs_infinite_window_keeps_the_oldest_verified():
    infos = [pfs(s, s * 1000.0) for s in range(10)]
    doomed = plan_warm_deletions(
        infos, 1e6, RetentionPolicy(keep_warm=1, keep_warm_every_s=math.inf)
    )
    assert doomed == list(range(1, 9))


def test_pfs_window_choice_is_stable_as_new_checkpoints_arrive():
    pol = RetentionPolicy(keep_warm=1, keep_warm_every_s=DAY)
    infos = []
    first_of_window = {}
    for s in range(40):
        t = s * 3 * 3600.0  # every 3 hours: 8 per day
        first_of_window.setdefault(math.floor(t / DAY), s)
        infos.append(pfs(s, t))
        doomed = plan_warm_deletions(infos, t + 1, pol)
        # The oldest checkpoint of a window is never deleted.
        assert not set(doomed) & set(first_of_window.values())
        infos = [i for i in infos if i.step not in doomed]  # apply, as the GC would
        # What survives: the first of each window plus the newest one.
        assert [i.step for i in infos] == sorted(set(first_of_window.values()) | {s})
        # Planning again right away deletes nothing: no churn.
        assert plan_warm_deletions(infos, t + 1, pol) == []


def test_pfs_keep_zero_still_keeps_newest_verified():
    infos = [pfs(s, s * 10.0) for s in range(5)]
    doomed = plan_warm_deletions(infos, 1e6, RetentionPolicy(keep_warm=0, keep_warm_every_s=0))
    assert doomed == [0, 1, 2, 3]


def test_pfs_newest_verified_kept_even_if_newer_ones_are_bad():
    infos = [pfs(1, 10), pfs(2, 20), pfs(3, 30, verified=False), pfs(4, 40, verified=False)]
    doomed = plan_warm_deletions(infos, 100, RetentionPolicy(keep_warm=0, keep_warm_every_s=0))
    # 2 is the newest verified; 3 and 4 may still be verifying.
    assert doomed == [1]


def test_pfs_old_unverified_copies_may_go():
    infos = [pfs(1, 10, verified=False), pfs(2, 20), pfs(3, 30)]
    doomed = plan_warm_deletions(infos, 100, RetentionPolicy(keep_warm=5, keep_warm_every_s=0))
    assert doomed == [1]


def test_pfs_nothing_verified_nothing_deleted():
    infos = [pfs(s, s, verified=False) for s in range(5)]
    assert plan_warm_deletions(infos, 100, RetentionPolicy(keep_warm=0, keep_warm_every_s=0)) == []


def test_pfs_pinned_and_next_tier_unverified_are_kept():
    infos = [
        pfs(1, 10, pinned=True),
        pfs(2, 20, nxt=False),
        pfs(3, 30, nxt=True),
        pfs(4, 40, nxt=None),
        pfs(5, 50),
    ]
    doomed = plan_warm_deletions(infos, 100, RetentionPolicy(keep_warm=1, keep_warm_every_s=0))
    assert doomed == [3, 4]


def test_pfs_future_commits_are_kept():
    infos = [pfs(1, 10), pfs(2, 5000), pfs(3, 30)]
    doomed = plan_warm_deletions(infos, 100, RetentionPolicy(keep_warm=1, keep_warm_every_s=0))
    # 2 is in the future (clock skew): kept. 3 is the newest by step.
    assert doomed == [1]


def test_pfs_empty():
    assert plan_warm_deletions([], 0.0) == []


# -- property tests -----------------------------------------------------------------------

policies = st.builds(
    RetentionPolicy,
    keep_local=st.integers(0, 6),
    flush_every=st.integers(1, 6),
    keep_warm=st.integers(0, 6),
    keep_warm_every_s=st.one_of(
        st.just(0.0), st.just(math.inf), st.floats(1.0, 10 * DAY, allow_nan=False)
    ),
)

local_infos = st.lists(
    st.builds(
        CkptInfo,
        step=st.integers(0, 60),
        wall_time=st.floats(0, 30 * DAY, allow_nan=False),
        seq=st.integers(-1, 60),
        nbytes=st.integers(0, 10**12),
        selected_for_flush=st.booleans(),
        forced=st.booleans(),
        pinned=st.booleans(),
        verified=st.booleans(),
        warm_verified=st.booleans(),
        next_tier_verified=st.none(),
    ),
    max_size=30,
)

pfs_infos = st.lists(
    st.builds(
        CkptInfo,
        step=st.integers(0, 60),
        wall_time=st.floats(0, 30 * DAY, allow_nan=False),
        seq=st.integers(0, 60),
        nbytes=st.integers(0, 10**12),
        selected_for_flush=st.booleans(),
        forced=st.booleans(),
        pinned=st.booleans(),
        verified=st.booleans(),
        warm_verified=st.booleans(),
        next_tier_verified=st.one_of(st.none(), st.booleans()),
    ),
    max_size=30,
)


@settings(max_examples=400, deadline=None)
@given(infos=local_infos, policy=policies)
def test_prop_local_invariants(infos, policy):
    doomed = plan_local_deletions(infos, policy)
    assert doomed == sorted(set(doomed))
    steps = {i.step for i in infos}
    assert set(doomed) <= steps
    for i in infos:
        if i.step in doomed:
            # The rule that cannot be configured away.
            assert not (needs_flush(i) and not i.warm_verified)
            assert not i.pinned
    # The newest keep_local distinct steps survive.
    newest = sorted(steps, reverse=True)[: policy.keep_local]
    assert not set(newest) & set(doomed)
    # Everything not protected and outside the newest keep_local goes.
    for s in steps - set(newest):
        entries = [i for i in infos if i.step == s]
        protected = any(i.pinned or (needs_flush(i) and not i.warm_verified) for i in entries)
        assert (s in doomed) == (not protected)
    # Order of the input does not matter.
    assert plan_local_deletions(list(reversed(infos)), policy) == doomed


@settings(max_examples=300, deadline=None)
@given(infos=local_infos, adversarial=st.integers(0, 3))
def test_prop_local_rule_survives_adversarial_policies(infos, adversarial):
    pol = [
        RetentionPolicy(keep_local=0, flush_every=1),
        RetentionPolicy(keep_local=0, flush_every=10**9),
        RetentionPolicy(keep_local=0, keep_warm=0, keep_warm_every_s=0),
        RetentionPolicy(keep_local=0, flush_every=2, keep_warm=0, keep_warm_every_s=math.inf),
    ][adversarial]
    doomed = set(plan_local_deletions(infos, pol))
    for i in infos:
        if needs_flush(i) and not i.warm_verified:
            assert i.step not in doomed


@settings(max_examples=400, deadline=None)
@given(infos=pfs_infos, policy=policies, now=st.floats(0, 40 * DAY, allow_nan=False))
def test_prop_pfs_invariants(infos, policy, now):
    doomed = set(plan_warm_deletions(infos, now, policy))
    assert sorted(doomed) == plan_warm_deletions(infos, now, policy)
    assert doomed <= {i.step for i in infos}
    verified = [i for i in infos if i.verified]
    if verified:
        newest = max(verified, key=lambda i: (i.step, i.wall_time))
        # Never delete the newest verified checkpoint.
        assert newest.step not in doomed
        # At least one verified checkpoint always survives.
        assert any(i.step not in doomed for i in verified)
        # The newest keep_warm verified steps survive.
        vsteps = sorted({i.step for i in verified}, reverse=True)[: policy.keep_warm]
        assert not set(vsteps) & doomed
    for i in infos:
        if i.step in doomed:
            assert not i.pinned
            assert i.next_tier_verified is not False
            assert i.wall_time <= now
    # Stability: applying the plan and planning again deletes nothing more.
    survivors = [i for i in infos if i.step not in doomed]
    assert plan_warm_deletions(survivors, now, policy) == []
    # Order of the input does not matter.
    assert set(plan_warm_deletions(list(reversed(infos)), now, policy)) == doomed


@settings(max_examples=200, deadline=None)
@given(
    policy=policies,
    gaps=st.lists(st.floats(60.0, 2 * DAY, allow_nan=False), min_size=1, max_size=40),
)
def test_prop_pfs_no_churn_over_a_growing_history(policy, gaps):
    """Simulate a run: checkpoints arrive, GC runs after each; a window keeper that was kept
    once (and whose window is closed) is never deleted later."""
    infos: list[CkptInfo] = []
    t = 0.0
    closed_keepers: set[int] = set()
    for step, gap in enumerate(gaps):
        t += gap
        infos.append(pfs(step, t))
        doomed = set(plan_warm_deletions(infos, t, policy))
        assert not doomed & closed_keepers
        infos = [i for i in infos if i.step not in doomed]
        w = policy.keep_warm_every_s
        if 0 < w < math.inf:
            current = math.floor(t / w)
            for i in infos:
                if math.floor(i.wall_time / w) < current:
                    # Only window keepers (or still-newest ones) survive in closed windows
                    # once more than keep_warm newer checkpoints exist.
                    newer = [j for j in infos if j.step > i.step]
                    if len(newer) >= max(policy.keep_warm, 1):
                        closed_keepers.add(i.step)
