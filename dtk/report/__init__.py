"""The report of a run: where its time went, how it compares, and pictures of both.

Reads only the run directory (metrics.jsonl, events.jsonl, summary.json, system.jsonl,
plan.json), so it runs on a login node or a laptop without torch. Plots need matplotlib,
imported only when plots are drawn. May import config and plan (both pure, torch-free),
checkpoint (the checkpoints a run committed: collect.py) and launch (Slurm's state of the job): the
plan's step-time model predicts the run's step from its plan.json (planned.py), the one
source of that prediction; the run directory's names (files, phases) are dtk.common.rundir's.

    runs.py     one run directory read into plain records
    goodput.py  job-lifetime accounting of wall time across restarts (also used by workers)
    numbers.py  the summary figures of one run
    compare.py  repeatability verdict between runs, comparison against a baseline
    plots.py    PNG figures
    text.py     the printed report
    planned.py  the measured step time and memory against the plan's prediction
    collect.py  where a run stands (python -m dtk.status, the handover's status.json)
    assemble.py the report of runs from its arguments (python -m dtk.report, the handover)
"""
