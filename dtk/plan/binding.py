"""How a worker step's tasks are bound to GPUs: the srun flags the driver starts the step
with, which each worker also reads to know which GPUs it was shown (dtk.worker.placement).
Here, below both, so that neither imports the other's stage (the worker no sbatch renderer)."""

from __future__ import annotations

from dtk.plan.plan import Plan


def gpu_step_flags(plan: Plan) -> list[str]:
    """srun flags that bind GPUs to the worker step's tasks: `cluster.gpu_bind` where the
    site file names one, else one GPU per task wherever each task can have its own
    (Slurm then shows each task only its GPU). The worker takes the GPU at its position
    among the tasks given the same GPUs (dtk.worker.placement), so a binding that shows a
    task several GPUs (closest: its socket's) works too."""
    cluster = plan.config.cluster
    if cluster.gpu_bind:
        return [f"--gpu-bind={cluster.gpu_bind}"]
    if 0 < plan.tasks_per_node <= cluster.gpus_per_node:
        return ["--gpus-per-task=1"]
    return []
