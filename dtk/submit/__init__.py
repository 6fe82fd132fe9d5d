"""python -m dtk.submit [overrides]: compose, plan and start a run (login node).

__main__.py is the command; start.py starts a planned run: the local driver in this process,
or the Slurm job whose batch script runs the driver (`dtk.driver.supervisor.drive`, handed to
submitit). May import any stage (it composes, plans and starts a run); no stage imports it.
The login-node path imports no torch.
"""
