"""driver: inside the allocation, start the worker step, watch it, relaunch, requeue.
May import config (the schema types of the slices it is handed: FaultConfig), plan, launch (slurmctl),
worker's torch-free tables (env, codes) and dtk.common.rundir; no torch."""
