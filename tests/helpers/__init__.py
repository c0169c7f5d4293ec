"""Shared test helpers: one CLI runner (:mod:`helpers.cli`), one site builder
(:mod:`helpers.site`), one SLURM dev-cluster fixture (:mod:`helpers.cluster`)."""
