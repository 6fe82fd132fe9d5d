"""driver: inside the allocation, start the worker step, watch it, relaunch, requeue.
May import plan, launch (slurmctl), worker's torch-free tables (env, codes) and dtk.rundir; no torch."""
