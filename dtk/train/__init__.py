"""train: the trainer, its loss, the step policies in order, optimizer and schedule, metrics, evaluation.
May import config, dist, parallel, models, data and dtk.rundir; not worker or checkpoint (handed in)."""
