"""train: the trainer, its loss, the step policies in order, optimizer and schedule, metrics, evaluation.
May import config, plan (pure: the accelerator table, the validation split's check), mesh, parallel,
models and data; not worker or checkpoint (handed in)."""
