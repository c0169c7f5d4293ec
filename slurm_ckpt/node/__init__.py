"""node layer: what runs on a compute node around the jobs - the one flush engine, the
guards that keep root-run code safe over user data, privilege drop, and the node work
(scan, reconcile, flush as the owner, retention) that prolog, epilog, stager and
``ckpt-slurm flush`` share."""
