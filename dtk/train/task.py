"""The task of a run: what one step computes from a batch (group `task`).

    task=lm                       next-token cross-entropy: a batch is (batch, seq_len + 1)
                                  token ids, the model gets [:, :-1], its logits are scored
                                  against [:, 1:] (the loss component of dtk.train.loss)
    task._target_=pkg.mod.loss    a callable of the user's:
                                    form=outputs  loss(outputs, batch), outputs = model(inputs)
                                    form=model    loss(model, batch), which runs the model itself
                                  returning the mean over the micro-batch's samples

A batch is whatever the data gives, as tensors: a tensor, or a tuple / dict of tensors.
Evaluation metrics (`task.metrics`: name -> callable of the loss's form) are means over the
micro-batch too; the evaluator weighs each by the micro-batch's samples, so a metric over
the validation set does not depend on how it was cut.

The trainer, the evaluator and a pipeline hold one Task, made once by the worker. Only the
token-LM task runs under a pipeline (the plan refuses the others): a pipeline's last stage
scores micro-batches with the loss component alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dtk.common.errors import UserError
from dtk.config.choices import TaskForm
from dtk.config.schema import TaskConfig
from dtk.data.batch import batch_size
from dtk.models.moe import aux_loss
from dtk.parallel.cp import CpLayout
from dtk.train.loss import Loss


class LmTask:
    """Next-token training on rows of token ids, scored by the run's loss component. Under
    context parallelism (`cp`, dtk.parallel.cp) every cp rank gets the same rows and trains
    on its slice of each: the loss is the whole sequence's mean. A mixture of experts'
    load-balancing loss (model=moe) is added to the training loss, not to the evaluated one."""

    def __init__(self, loss: Loss, *, metrics: Mapping[str, Callable[..., torch.Tensor]] | None = None,
                 cp: CpLayout | None = None) -> None:
        self.loss = loss
        self.metrics = dict(metrics or {})
        if cp is not None and self.metrics:
            raise UserError(f"task.metrics with scheme.cp={cp.size}: a metric is called with whole rows, and a"
                            " context-parallel rank holds a slice of each; drop task.metrics or use scheme.cp=1")
        self.cp = cp

    def split(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of a batch of token rows (this cp rank's slice of both)."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if self.cp is not None:
            return self.cp.shard(inputs), self.cp.shard(targets)
        return inputs, targets

    def __call__(self, model: torch.nn.Module, batch: torch.Tensor, autocast: contextlib.AbstractContextManager) -> torch.Tensor:
        inputs, targets = self.split(batch)
        with autocast:
            logits = model(inputs)
        loss = self.loss(logits, targets)
        balance = aux_loss(model)  # model=moe: the blocks' load-balancing loss (dtk.models.moe)
        if balance is not None:
            loss = loss + balance
        return loss if self.cp is None else self.cp.mean(loss)

    def sums(self, model: torch.nn.Module, batch: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Per name, a sum and its count: the loss summed over target tokens, each metric
        (a mean over the micro-batch) times its samples."""
        inputs, targets = self.split(batch)
        logits = model(inputs)
        summed, count = self.loss.total(logits, targets)
        if self.cp is not None:
            summed, count = self.cp.total(summed, count)
        sums, counts = {"loss": summed}, {"loss": count}
        n = len(batch)
        for name, metric in self.metrics.items():
            sums[name], counts[name] = metric(logits, batch) * n, n
        return sums, counts


def _select(batch: Any, inputs: str | None) -> Any:
    """What the model's forward takes of a batch (task.inputs)."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        if inputs is None:
            return batch
        if inputs not in batch:
            raise UserError(f"task.inputs={inputs}: the batch is a dict with keys {sorted(batch)}; name one of them")
        return batch[inputs]
    if isinstance(batch, (tuple, list)):
        index = 0 if inputs is None else inputs
        try:
            return batch[int(index)]
        except (ValueError, IndexError):
            raise UserError(
                f"task.inputs={inputs}: the batch is a tuple of {len(batch)}; give an index in 0..{len(batch) - 1}"
            ) from None
    raise UserError(f"a batch of type {type(batch).__name__}: expected a tensor, or a tuple / dict of tensors")


class UserTask:
    """A loss and metrics of the user's (see the module doc)."""

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        *,
        form: TaskForm,
        inputs: str | None,
        metrics: Mapping[str, Callable[..., torch.Tensor]],
        target: str,
    ) -> None:
        self.fn, self.form, self.inputs, self.metrics, self.target = fn, form, inputs, dict(metrics), target

    def _check(self, value: Any, what: str) -> torch.Tensor:
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise UserError(f"{what} returned {got}: expected a one-element tensor (the mean over the micro-batch)")
        return value.reshape(())

    def __call__(self, model: torch.nn.Module, batch: Any, autocast: contextlib.AbstractContextManager) -> torch.Tensor:
        if self.form == TaskForm.model:
            with autocast:
                return self._check(self.fn(model, batch), f"task._target_={self.target}")
        with autocast:
            outputs = model(_select(batch, self.inputs))
        return self._check(self.fn(outputs, batch), f"task._target_={self.target}")

    def sums(self, model: torch.nn.Module, batch: Any) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        n = batch_size(batch)
        first = model if self.form == TaskForm.model else model(_select(batch, self.inputs))
        sums = {"loss": self._check(self.fn(first, batch), f"task._target_={self.target}") * n}
        for name, metric in self.metrics.items():
            sums[name] = self._check(metric(first, batch), f"task.metrics.{name}") * n
        return sums, dict.fromkeys(sums, n)


Task = LmTask | UserTask


def _locate(target: str, key: str) -> Callable[..., Any]:
    from dtk.data.user import locate

    fn = locate(target, key)
    if not callable(fn):
        raise UserError(f"{key}={target}: not a callable")
    return fn


def build_task(task: TaskConfig, *, loss: Loss, cp: CpLayout | None = None) -> Task:
    """The run's task from its config; `loss` is the loss component the LM task scores with
    (and a pipeline's last stage); `cp`: this rank's context-parallel layout (the plan runs
    only the LM task under it)."""
    if "loss" in task.metrics:
        raise UserError("task.metrics.loss: the loss is logged as val_loss already; give the metric another name")
    metrics = {name: _locate(target, f"task.metrics.{name}") for name, target in task.metrics.items()}
    if task._target_ is None:
        return LmTask(loss, metrics=metrics, cp=cp)
    return UserTask(
        _locate(task._target_, "task._target_"), form=task.form, inputs=task.inputs, metrics=metrics,
        target=task._target_,
    )
