"""The campaign engine: runs scenarios with seeded random timing and collects figures.

A *run* is one training job series on a fresh :class:`~tests.faults.site.FaultSite`: prolog,
trainer, fault, epilog (and stager when the node stays drained), restart ..., until the
trainer finishes. :class:`Run` holds the steps every scenario shares and checks the
invariants (:mod:`tests.faults.invariants`) after each of them; a scenario
(:mod:`tests.faults.scenarios`) only decides which fault strikes when.

Figures: scenarios x runs, faults injected (by kind), invariant violations, restarts,
steps lost per restart (max and median).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set

from tests.faults.invariants import Tracker
from tests.faults.site import RETRY_BACKOFF_S, FaultSite, Worker
from tests.faults.worker import reference_digests

STEPS = 40
INTERVAL = 5
SIZE = 1 << 16  # float32 values per array: 2 x 256 KiB per checkpoint
SLEEP = 0.02


@functools.lru_cache(maxsize=8)
def _reference(size: int, seed: int, steps: int) -> List[str]:
    return reference_digests(size, seed, steps)


@dataclass
class RunResult:
    scenario: str
    run: int
    seed: int
    faults: Dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    drains: int = 0
    lost: List[int] = field(default_factory=list)
    violations: List[str] = field(default_factory=list)
    error: Optional[str] = None
    hook_log: str = ""
    seconds: float = 0.0
    #: what a scenario wants in the report besides the figures (e.g. the I5 bound)
    notes: List[str] = field(default_factory=list)


class Run:
    """One run of a scenario: the shared job cycle and the invariant checks."""

    def __init__(self, site: FaultSite, rng: random.Random, result: RunResult, **params: Any):
        self.site = site
        self.rng = rng
        self.result = result
        self.key = params.get("key", "run")
        self.steps = params.get("steps", STEPS)
        self.interval = params.get("interval", INTERVAL)
        self.size = params.get("size", SIZE)
        self.seed = params.get("seed", 1)
        self.sleep = params.get("sleep", SLEEP)
        self.tracker = Tracker(site, self.key, params.get("keys"))
        self.faults: Counter[str] = Counter()
        self.job: Optional[str] = None
        self.restart = 0
        self.graceful = False  # the last interruption was a signal the trainer answers

    @property
    def ref(self) -> List[str]:
        return _reference(self.size, self.seed, self.steps)

    def fault(self, kind: str, n: int = 1) -> None:
        self.faults[kind] += n

    def check(self, cond: bool, text: str) -> None:
        if not cond:
            self.tracker.violation(text)

    # -- the job cycle ------------------------------------------------------------------
    def start(
        self,
        node: str,
        key: Optional[str] = None,
        new_job: bool = False,
        racy: bool = False,
        refused: bool = False,
        holder: Optional[Worker] = None,
        **kw: Any,
    ) -> Worker:
        """Prolog, then the trainer; checks where it resumed (I4) and what it loaded (I1).

        ``racy``: another trainer or hook may commit newer steps while this one starts,
        so it may resume at a newer step than the one computed beforehand. ``refused``:
        another live writer holds the key, so the trainer must stop at construction with
        the one line naming it (one writer per series), before touching anything."""
        key = key or self.key
        first = self.job is None
        if first or new_job:
            self.job = self.site.new_job()
        restart = 0 if first or new_job else self.restart
        self.site.run_hook("prolog", node, self.job, restart)
        self.tracker.observe(f"before start on {node}")
        expected = self.tracker.newest_readable(node, key)
        reached = self.site.reached(key)
        args = dict(steps=self.steps, interval=self.interval, size=self.size, seed=self.seed)
        args.update(sleep=self.sleep)
        args.update(kw)
        w = self.site.worker(node, self.job, key, restart, **args)
        if refused:
            rc = w.finish()
            if rc == 0 and holder is not None and _ended_first(holder, w):
                # On a loaded machine the live writer (``holder``) may finish its run
                # before this one gets to construction: nothing is left to refuse, and
                # this one resumed at the very step the first one ended with.
                self.result.notes.append(f"the first writer of {key} had ended: not refused")
                return w
            self.check(
                rc != 0 and "is being written by pid" in w.tail(),
                f"a second writer of {key} on {node} was not refused (exit {rc}):\n{w.tail()}",
            )
            return w
        m = w.wait_for(r"^(START fresh|RESUMED step=(\d+) tier=(\S+) digest=(\S+))$", 60)
        if m is None:
            if kw.get("crash_at") is not None and w.finish() == -signal.SIGKILL:
                # Killed at its own crash point before it could start (a copy or write of
                # its restore, its lease): the fault injected, which the scenario counts;
                # the next start is checked as after any other kill.
                self.result.notes.append(f"trainer on {node} killed at a crash point at start")
                return w
            self.check(False, f"trainer on {node} exited before starting:\n{w.tail()}")
            return w
        got = None if m.group(2) is None else int(m.group(2))
        if not first or got is not None:
            self.check(
                got == expected or (racy and (got or 0) >= (expected or 0)),
                f"I4 restart on {node}: resumed at {got}, newest readable verified step {expected}",
            )
            if got is not None:
                self.check(
                    m.group(4) == self.ref[got],
                    f"I1 restart on {node}: state loaded for step {got} differs from the one saved",
                )
            lost = max(0, reached - (got or 0))
            if not first and not new_job:
                self.result.restarts += 1
                self.result.lost.append(lost)
                if self.graceful:
                    self.check(lost == 0, f"I4 restart after SIGTERM lost {lost} steps")
        return w

    def wait_step(self, w: Worker, step: int) -> bool:
        """Until the trainer completed ``step`` (False if it ended first)."""
        deadline = time.monotonic() + 60
        while self.site.reached(self.key) < step:
            if w.proc.poll() is not None or time.monotonic() > deadline:
                return self.site.reached(self.key) >= step
            time.sleep(0.01)
        return True

    def interrupt(self, w: Worker, sig: int = signal.SIGKILL) -> None:
        """Kill (or signal) the trainer; checks the one-interval bound afterwards (I4)."""
        w.kill(sig)
        w.finish()
        self.fault("trainer SIGKILL" if sig == signal.SIGKILL else "trainer SIGTERM")
        saved, committed = w.steps("SAVED"), w.steps("COMMITTED")
        # After SIGTERM nothing may be lost - if the save it triggers could be written
        # (on a full or failing disk it cannot: then the newest committed step counts).
        preempted = w.steps("PREEMPTED")
        self.graceful = bool(preempted) and preempted[-1] in committed
        reached = self.site.reached(self.key)
        if not self.graceful and saved and committed and saved[-1] == committed[-1]:
            self.check(
                reached - committed[-1] <= self.interval,
                f"I4 kill at step {reached}: newest commit {committed[-1]} is more than one "
                f"interval ({self.interval}) behind",
            )
        self.restart += 1

    def end_job(self, node: str, w: Worker, *, epilog: bool = True) -> Set[int]:
        """After the trainer exited: the local commits it leaves (I1/I2 checked), then the
        epilog (I3). Returns the steps still owed to the PFS after the epilog."""
        if w.proc.poll() is None:
            w.finish()
        self.tracker.observe(f"job end on {node}")
        committed = self.tracker.committed_local(node, self.key)
        if not epilog:
            return set()
        assert self.job is not None
        self.site.run_hook("epilog", node, self.job, self.restart)
        self.tracker.observe(f"after epilog on {node}")
        if self.tracker.check_flushed(node, self.key, committed, f"after epilog on {node}"):
            return set()
        if (self.site.node_reason(node) or "").startswith("slurm_ckpt:"):
            self.result.drains += 1
        return committed

    def stager(self, node: str, committed: Set[int], kill_after: Optional[float] = None) -> None:
        """The stager's pass (optionally SIGKILLed after ``kill_after`` s, then run again);
        afterwards everything must be on the PFS and the node back in service."""
        if kill_after is not None:
            proc = self.site.stager(node)
            try:
                proc.wait(timeout=kill_after)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                self.fault("stager SIGKILL")
            self.tracker.observe(f"after killed stager on {node}")
        # A failed flush is retried after hooks.retry_backoff (RETRY_BACKOFF_S here,
        # doubling): the stager daemon passes again until nothing is owed; a few passes at
        # most, each once the backoff since the last failure is over.
        for attempt in range(4):
            time.sleep(RETRY_BACKOFF_S * 2**attempt)
            proc = self.site.stager(node)
            out, _ = proc.communicate(timeout=300)
            if not self.tracker.unflushed(node, self.key, committed):
                break
        self.tracker.observe(f"after stager on {node}")
        missing = self.tracker.unflushed(node, self.key, committed)
        self.check(
            not missing, f"I3 after stager on {node}: {sorted(missing)} not on the PFS: {out}"
        )
        reason = self.site.node_reason(node)
        self.check(
            not (reason or "").startswith("slurm_ckpt:"),
            f"stager left {node} drained ({reason!r}) with nothing owed: {out}",
        )

    def finish(self, node: str, **kw: Any) -> None:
        """Restart until the trainer completes; the final state must equal the reference."""
        for _ in range(5):
            w = self.start(node, **kw)
            w.finish(timeout=300)
            done = w.wait_for(r"^DONE step=(\d+) digest=(\S+)$", 1)
            owed = self.end_job(node, w)
            if owed:
                self.stager(node, owed)
            if done is not None:
                step, dig = int(done.group(1)), done.group(2)
                self.check(
                    step == self.steps and dig == self.ref[self.steps],
                    f"final state after {self.result.restarts} restarts differs from the "
                    f"uninterrupted run (step {step})",
                )
                return
            self.restart += 1
            self.graceful = False
        self.check(False, f"trainer never finished:\n{w.tail()}")


Scenario = Callable[[Run], None]


def _ended_first(holder: Worker, w: Worker) -> bool:
    """Had ``holder`` ended its run (``DONE step=N``) when ``w`` resumed - at that step N?
    A writer that resumed at an older step while the holder still trained was not kept
    out, and that is a violation."""
    try:
        done = holder.wait_for(r"^DONE step=(\d+) ", 5)
    except AssertionError:  # still training: it had not ended
        return False
    got = w.wait_for(r"^RESUMED step=(\d+) ", 0.1)
    return done is not None and got is not None and done.group(1) == got.group(1)


def run_one(
    name: str,
    scenario: Scenario,
    setup: Callable[[FaultSite], Dict[str, Any]],
    index: int,
    seed: int,
    cluster_env: Dict[str, str],
    nodes: List[str],
) -> RunResult:
    result = RunResult(name, index, seed)
    t0 = time.monotonic()
    site = FaultSite(cluster_env, nodes, f"{name}-{index}")
    try:
        params = setup(site) or {}
        run = Run(site, random.Random(seed), result, **params)
        try:
            scenario(run)
        finally:
            result.faults = dict(run.faults)
            result.violations = list(run.tracker.violations)
            if result.violations and site.log.exists():
                result.hook_log = "\n".join(site.log.read_text().splitlines()[-12:])
    except Exception:  # noqa: BLE001 - a broken run is reported, the campaign goes on
        result.error = traceback.format_exc(limit=8)
    finally:
        site.close()
    result.seconds = time.monotonic() - t0
    return result


def figures(results: List[RunResult], seed: int, runs: int) -> Dict[str, Any]:
    lost = [x for r in results for x in r.lost]
    faults: Counter[str] = Counter()
    for r in results:
        faults.update(r.faults)
    scenarios = sorted({r.scenario for r in results})
    return {
        "seed": seed,
        "runs_per_scenario": runs,
        "scenarios": len(scenarios),
        "runs": len(results),
        "faults_injected": sum(faults.values()),
        "faults_by_kind": dict(sorted(faults.items())),
        "violations": sum(len(r.violations) for r in results),
        "errors": sum(1 for r in results if r.error),
        "restarts": sum(r.restarts for r in results),
        "drains": sum(r.drains for r in results),
        "lost_max": max(lost, default=0),
        "lost_median": statistics.median(lost) if lost else 0,
        "interval": INTERVAL,
        "seconds": round(sum(r.seconds for r in results), 1),
        "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.release()}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "per_scenario": {
            s: {
                "runs": sum(1 for r in results if r.scenario == s),
                "faults": sum(sum(r.faults.values()) for r in results if r.scenario == s),
                "violations": sum(len(r.violations) for r in results if r.scenario == s),
                "errors": sum(1 for r in results if r.scenario == s and r.error),
                "restarts": sum(r.restarts for r in results if r.scenario == s),
                "lost_max": max((x for r in results if r.scenario == s for x in r.lost), default=0),
            }
            for s in scenarios
        },
    }


def markdown(fig: Dict[str, Any]) -> str:
    lines = [
        "# Fault campaign figures",
        "",
        "Written by `python -m tests.faults` (do not edit by hand); rerun with "
        f"`python -m tests.faults --runs {fig['runs_per_scenario']} --seed {fig['seed']}`.",
        "",
        (
            f"* scenarios x runs: {fig['scenarios']} x {fig['runs_per_scenario']} = "
            f"{fig['runs']} runs"
            if fig["scenarios"] * fig["runs_per_scenario"] == fig["runs"]
            else f"* {fig['runs']} runs of {fig['scenarios']} scenarios (up to "
            f"{fig['runs_per_scenario']} each: see the table)"
        ),
        f"* faults injected: {fig['faults_injected']}",
        f"* invariant violations: {fig['violations']}",
        f"* runs that broke down (harness errors): {fig['errors']}",
        f"* restarts: {fig['restarts']}",
        f"* nodes the epilog left drained (`slurm_ckpt:` reason) until the stager finished: "
        f"{fig['drains']}",
        f"* steps lost per restart: max {fig['lost_max']}, median {fig['lost_median']} "
        f"(checkpoint interval: {fig['interval']} steps)",
        f"* machine: {fig['machine']}; {fig['seconds']} s of runs",
        "",
        "| scenario | runs | faults | violations | errors | restarts | max lost |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, s in fig["per_scenario"].items():
        lines.append(
            f"| {name} | {s['runs']} | {s['faults']} | {s['violations']} | {s['errors']} | "
            f"{s['restarts']} | {s['lost_max']} |"
        )
    if fig.get("provenance"):
        lines += ["", "Where each scenario's figures come from (merged with `--merge`):", ""]
        by_source: Dict[str, List[str]] = {}
        for name, src in sorted(fig["provenance"].items()):
            by_source.setdefault(src, []).append(name)
        lines += [f"* {src}: {', '.join(names)}" for src, names in sorted(by_source.items())]
    lines += ["", "Faults by kind:", ""]
    lines += [f"* {k}: {v}" for k, v in fig["faults_by_kind"].items()]
    return "\n".join(lines) + "\n"


def merge_figures(out: Path, sources: List[Path], earlier: str) -> Dict[str, Any]:
    """The figures in ``out`` with the runs of ``sources`` (campaign outputs of some
    scenarios) in place of theirs; every scenario keeps a note of where its runs come
    from (``earlier`` for those already in ``out`` without one). Writes ``out``."""
    old = json.loads((out / "figures.json").read_text())
    provenance: Dict[str, str] = dict(old["figures"].get("provenance") or {})
    runs: Dict[str, List[RunResult]] = {}
    for r in old["runs"]:
        runs.setdefault(r["scenario"], []).append(RunResult(**r))
        provenance.setdefault(r["scenario"], earlier)
    new: Dict[str, List[RunResult]] = {}
    for src in sources:
        data = json.loads((src / "figures.json").read_text())
        fig = data["figures"]
        when = fig.get("date") or time.strftime(
            "%Y-%m-%d", time.gmtime((src / "figures.json").stat().st_mtime)
        )
        for r in data["runs"]:
            new.setdefault(r["scenario"], []).append(RunResult(**r))
            provenance[r["scenario"]] = (
                f"rerun on this code {when} (`--runs {fig['runs_per_scenario']} "
                f"--seed {fig['seed']} --scenarios {r['scenario']}`)"
            )
    runs.update(new)
    results = [r for name in sorted(runs) for r in runs[name]]
    per_run = {len(v) for v in runs.values()}
    fig = figures(results, old["figures"]["seed"], max(per_run))
    fig["provenance"] = provenance
    fig["machine"] = old["figures"]["machine"]
    write_figures(fig, results, out)
    return fig


def write_figures(fig: Dict[str, Any], results: List[RunResult], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "figures.json").write_text(
        json.dumps({"figures": fig, "runs": [asdict(r) for r in results]}, indent=1) + "\n"
    )
    (out / "FIGURES.md").write_text(markdown(fig))
