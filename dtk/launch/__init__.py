"""launch: the plan becomes running workers (local processes or an sbatch job); the sbatch text.
May import config, plan and access (who may submit); not driver, which imports launch's Slurm layer
(dtk.submit.start joins the two); no torch (it runs on the login node)."""
