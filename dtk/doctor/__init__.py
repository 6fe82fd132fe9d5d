"""python -m dtk.doctor: a short job that measures the fabric and names slow nodes.

__main__ (login node, no torch) composes the config and launches the job; worker.py is one
rank of it; measure.py the collective measurements; report.py the verdict and the report.
May import config, plan, topology, mesh, worker (env), launch and driver (the exclusion file).
"""
