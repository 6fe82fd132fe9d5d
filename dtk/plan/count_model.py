"""A user's `_target_` model counted on the meta device, in a subprocess with a time limit.

The login-node path imports no torch: `count_user_model` starts
`python -m dtk.parallel.count` (the torch side, after the planner's layer), which builds the model on the meta device (no memory, no
initialisation) and prints each parameter's name, shape, pipeline unit, whether the unit is
a block, the dimension the model's tp_plan splits and whether it is a matmul weight, as
JSON. Activations of a user model are not estimated (its forward is its own): the budget
says so, and `plan.hidden` / `plan.seq_len` give a transformer-shaped estimate instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dtk.config.convert import model_to_dict
from dtk.config.schema import ModelConfig
from dtk.errors import UserError
from dtk.plan.shape import ModelShape, shape_from_counted

COUNT_TIMEOUT_S = 60
EXIT_USER_ERROR = 2  # the subprocess found a mistake in the model's keys; its last stderr line says which


class NotCounted(UserError):
    """The model could not be built on the meta device (or not in time): `python -m dtk.plan`
    says so as an error; dtk.submit submits without the memory check, and says so."""


def count_user_model(model: ModelConfig, timeout_s: float = COUNT_TIMEOUT_S) -> ModelShape:
    target = model._target_
    # What this process imports from (a project folder that --config-dir or the search path
    # put on sys.path included), so the subprocess finds the model where the workers will.
    path = os.pathsep.join(p for p in sys.path if p)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "dtk.parallel.count"], input=json.dumps(model_to_dict(model)),
            capture_output=True, text=True, timeout=timeout_s, env={**os.environ, "PYTHONPATH": path},
        )
    except subprocess.TimeoutExpired:
        raise NotCounted(
            f"model._target_={target}: building it on the meta device to count its parameters took over"
            f" {timeout_s:.0f} s; set plan.params (and plan.layers) to plan without building it"
        ) from None
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    if proc.returncode == EXIT_USER_ERROR and last.startswith("error: "):
        # The keys do not fit the model: the workers would fail the same way, after the queue.
        raise UserError(last.removeprefix("error: "))
    if proc.returncode != 0:
        raise NotCounted(f"model._target_={target}: cannot count its parameters on the meta device: {last}")
    return shape_from_counted(json.loads(proc.stdout))
