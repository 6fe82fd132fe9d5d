"""A user's `_target_` model counted on the meta device, in a subprocess with a time limit.

The login-node path imports no torch: `count_user_model` starts `python -m
dtk.parallel.count` (the torch side, after the planner's layer), which builds the model on
the meta device (no memory, no initialisation) and writes each parameter's name, shape, pipeline unit, whether the unit is
a block, the dimension the model's tp_plan splits and whether it is a matmul weight, as
JSON, to a file of this process's temporary folder: the constructor's own output (a model
that prints its size) is not the record. What the subprocess printed, the model's prints
among it, goes to this command's stderr once the count succeeded, each line after `model
output: ` (a failure is one `error:` line, or the `note:` of dtk.submit).

The time limit is `plan.count_timeout_s`; its message names that key, which both
`python -m dtk.plan` and `dtk.submit` take (the what-if keys `plan.params` and
`plan.layers` are dtk.plan's alone). Activations of a user model are not estimated (its
forward is its own): the budget says so, and `plan.hidden` / `plan.seq_len` give a
transformer-shaped estimate instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from dtk.common.errors import UserError
from dtk.config.convert import model_to_dict
from dtk.config.schema import ModelConfig
from dtk.plan.shape import ModelShape, shape_from_counted

EXIT_USER_ERROR = 2  # the subprocess found a mistake in the model's keys; its result file has the line


class NotCounted(UserError):
    """The model could not be built on the meta device (or not in time): `python -m dtk.plan`
    says so as an error; dtk.submit submits without the memory check, and says so."""


def count_user_model(model: ModelConfig, timeout_s: float) -> ModelShape:
    """The model's shape, counted in `python -m dtk.parallel.count` within `timeout_s`
    (plan.count_timeout_s)."""
    target = model._target_
    # What this process imports from (a project folder that --config-dir or the search path
    # put on sys.path included), so the subprocess finds the model where the workers will.
    path = os.pathsep.join(p for p in sys.path if p)
    with tempfile.TemporaryDirectory(prefix="dtk-count-") as tmp:
        result = Path(tmp) / "count.json"
        given = {"model": model_to_dict(model), "result": str(result)}
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "dtk.parallel.count"], input=json.dumps(given), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, timeout=timeout_s, env={**os.environ, "PYTHONPATH": path},
            )
        except subprocess.TimeoutExpired:
            raise NotCounted(
                f"model._target_={target}: building it on the meta device to count its parameters took over"
                f" plan.count_timeout_s={timeout_s:g} s; give it longer (plan.count_timeout_s={4 * timeout_s:g})"
            ) from None
        try:
            written = json.loads(result.read_text())
        except (OSError, ValueError):  # not written: the subprocess died before its end
            written = {}
    if proc.returncode == EXIT_USER_ERROR and "error" in written:
        # The keys do not fit the model: the workers would fail the same way, after the queue.
        raise UserError(written["error"])
    if proc.returncode != 0 or "record" not in written:
        last = (proc.stdout.strip().splitlines() or ["no output"])[-1]
        raise NotCounted(f"model._target_={target}: cannot count its parameters on the meta device: {last}")
    relay(proc.stdout)  # a failure is one line, above
    return shape_from_counted(written["record"])


def relay(output: str) -> None:
    """What the counting subprocess printed (the model's own prints, a library's warnings)
    goes to this command's stderr: the user sees it, and stdout stays the command's."""
    for line in output.rstrip().splitlines():
        print(f"model output: {line}", file=sys.stderr)
