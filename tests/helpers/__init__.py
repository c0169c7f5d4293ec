"""Shared test helpers: one CLI runner (:mod:`helpers.cli`), one site builder
(:mod:`helpers.site`), one SLURM dev-cluster fixture (:mod:`helpers.cluster`), the tiny
model of the in-job recovery workers (:mod:`helpers.tiny_model`), and one reader of a
node's metrics textfile (:mod:`helpers.metrics`)."""
