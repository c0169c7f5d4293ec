"""Admission control for flushes to the shared (warm) tier: one package for the policy,
the shared state, the root-owned store and the gate around a copy.

Why: the write burst of a checkpoint is the cluster's problem, not the job's. Every node
caps its own flush bandwidth, but nothing stops 2,000 nodes from flushing in the same
second, and while they do every other job's reads stall. So a node asks for a *slot*
before it flushes to the PFS:

* **cap**: at most ``max_nodes`` holders at once, and/or at most ``max_bandwidth`` bytes/s
  summed over the holders' rates;
* **lease**: a holder renews its slot while it flushes; a holder that died (node crash,
  SIGKILL) stops renewing, and its slot is free again ``lease`` seconds after its last
  renewal, by itself, with no one to clean up;
* **jitter**: a flush starts after a random delay in ``[0, jitter)``, so that the nodes of
  a job that all saved at the same step do not all ask in the same second;
* **priority**: the queue is ordered by priority, then arrival: a node draining for
  maintenance (an admin waits on it) or a preempted job's flush (its last chance) goes
  before a routine one. Within a priority, first come first served, and no one overtakes
  the head of the queue (a big request is never starved by small ones);
* **budget**: every waiter has a deadline. When it passes, the answer is "not admitted"
  and the waiter leaves the queue: the caller hands the flush off (to the stager) instead
  of waiting past its own time limit.

The modules, bottom up:

* :mod:`~slurm_ckpt.admission.policy`: the caps and timings (``[admission]``), the
  priorities, :class:`~slurm_ckpt.admission.policy.AdmissionError`;
* :mod:`~slurm_ckpt.admission.state`: the shared state (the holders and the queue of
  waiters) and the store protocol, with a store in memory
  (:class:`~slurm_ckpt.admission.state.MemoryStore`, an injectable clock: tests, the
  fleet simulation in ``benchmarks/fleet_sim.py``);
* :mod:`~slurm_ckpt.admission.decisions`: every decision, made on that state inside one
  store transaction (:class:`~slurm_ckpt.admission.decisions.Admission`);
* :mod:`~slurm_ckpt.admission.store`: the state as a root-owned file on the shared tier
  under a lock (:class:`~slurm_ckpt.admission.store.PosixSlotStore`);
* :mod:`~slurm_ckpt.admission.gate`: the flush engine's side, a slot held around one copy
  and renewed from a forked child (:class:`~slurm_ckpt.admission.gate.SlotGate`).

The same :class:`~slurm_ckpt.admission.decisions.Admission` runs against either store,
so what the simulation shows at 10,000 nodes is what this code does.

Costs stay constant per node as the cluster grows: a waiter's entry carries its own
deadline (no renewals while waiting), the queue is kept sorted, and a decision walks only
the head of the queue (as many entries as there are free slots, plus any that expired
there), never the whole of it.
:attr:`~slurm_ckpt.admission.state.SlotState.examined` counts those steps.

Its place in the layers: ``errors → core → tiers → ledger → admission → slurm → node``.
It uses only ``core`` (config, file and trust checks) and ``ledger`` (the event log its
decisions go to); the flush engine (``node``) and ``ops`` use it. No SLURM, no torch.
"""
