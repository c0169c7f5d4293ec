"""vulture's false positives in the product (``tests/test_lint.py`` runs vulture with this
file): names that are used, but not by a call vulture can see. Each group says why.
A name belongs here only when it is used; dead code is deleted instead.
"""

# ruff: noqa: B018, F821
# mypy: ignore-errors

# Module protocol (PEP 562): slurm_ckpt's lazy attributes.
__getattr__
__dir__

# click: commands registered by name (cli/app.py COMMANDS) or by decorator, and the
# methods click calls on our ParamType/Group subclasses.
list_cmd
verify_cmd
drill_cmd
gc_cmd
restore_cmd
seal_cmd
report_cmd
goodput_cmd
adopt_cmd
config_show
config_check
_.format_commands
_.get_metavar
_.convert

# prometheus_client's collector protocol: the registry calls describe() on a collector
# (ledger/metrics.py _Collector).
_.describe

# Context managers' __exit__ parameters (the protocol names them).
exc_type
tb

# dataclass fields that leave through asdict()/to_dict() (JSON, --json, benchmarks).
burst_demand
tenant_demand
flow_rate
pool_load
peak_throughput
wait_p99
job_wait

# Public statistics and environment a user's code reads (Checkpointer.stats, JobEnv).
# (CheckpointStats.last_snapshot_s is never set today: a candidate to remove with the
# Checkpointer's options, not here.)
last_snapshot_s
last_flush_s
_.last_flush_s
step_id
_.in_slurm
_.nnodes

# Counters of the admission stores (the SlotStore protocol: ops, peeks), read by the
# fleet simulation's report and by tests.
peeks
_.peeks

# io.RawIOBase protocol of the object tier's streaming reader.
_.readable
_.seekable
_.tell

# torch.nn.Module.forward, called through Module.__call__.
_.forward

# Framework protocols: methods and attributes torch.distributed.checkpoint, HF's Trainer
# and Lightning call or read on our StorageWriter/Reader, TrainerCallback and plugins.
reset
set_up_storage_writer
set_up_storage_reader
prepare_local_plan
prepare_global_plan
validate_checkpoint_id
write_data
read_metadata
read_data
load_id
on_step_end
on_save
should_training_stop
on_train_start
on_train_batch_end
on_exception
on_train_end
state_key
should_stop
pl_module
# ... and what Lightning calls on a LightningModule (examples/lightning_train.py).
batch_idx
on_save_checkpoint
configure_optimizers

# Goodput figures that leave through to_dict() (plan --strategies --json).
waste_per_failure_s
failures_per_day

# CheckpointStats of the lazy snapshot, read by users and benchmarks (stats).
last_drain_s

# PartnerStats counters, read by users and tests (Checkpointer.partner.stats).
send_skipped
bytes_sent
bytes_received
last_sent_step
last_received_step

# The deprecated option alias pfs_bandwidth= (kept one release): Checkpointer.__init__
# passes it on through locals(), and job/options.resolve_aliases reads it with getattr.
pfs_bandwidth

# The deprecated Python names of retention.keep_warm/keep_warm_every (kept one release
# for code that reads config.retention.keep_pfs*; tests/test_warm_aliases.py uses them).
keep_pfs_every

# The RAM tier's counters (job/ram_replica.py RamStats, job/stats.py ram_*): public
# stats a user or a metrics scrape reads; set through dataclasses.replace(**) or
# RamCopies._count(**), which vulture cannot follow.
_.bytes_own
_.bytes_partner
_.last_replicated_step
_.ram_behind
_.ram_not_taken
_.ram_replica_failures
_.ram_every
