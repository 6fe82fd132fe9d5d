"""driver: inside the allocation, start the worker step, watch it, relaunch, requeue.
May import config (the schema types of the slices it is handed: FaultConfig), plan, launch (slurmctl),
worker's torch-free tables (env, codes) and dtk.common (rundir; storage: the committed checkpoints, in an
object store too); no torch."""
