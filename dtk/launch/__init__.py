"""launch: the plan becomes running workers (local processes or an sbatch job); the sbatch text.
May import config, plan, driver and dtk.rundir; no torch (it runs on the login node)."""
