"""The planner's cost model and its search: what a job costs under a scheme (memory per device,
activations, traffic per mesh axis, step time), the budget of every scheme at a size, the
searched recommendation, the memory gate before the queue and the plan's reports (plan.md,
`python -m dtk.plan`). Pure arithmetic, no torch: the login node runs it; a worker reads its
own prediction (predict.py).

The rules every stage shares (degrees and the axis table, the rank layout, the model's shape,
the accelerator table, run identity) are in dtk/plan/ itself, and this package builds on them.
"""
