"""python -m dtk.drill KIND RUN_DIR: a fault put into a running run on purpose (preempt, time
limit, node failure, crash, hang, storage, nan), to see the recovery do its work.

__main__.py is the command; storage.py takes a run's checkpoint storage away and gives it back.
May import any stage (it reads the run and signals its processes); no stage imports it.
"""
