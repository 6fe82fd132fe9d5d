"""The task group: next-token cross-entropy by default, a user's loss and metrics on batches
that are tensors, tuples or dicts, user datasets and tasks composed from config, and the
plan's refusal of a pipeline for any task but the token LM. One process, tiny models."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dtk.common.errors import UserError
from dtk.config.choices import TaskForm
from dtk.config.compose import compose
from dtk.config.identity import identity_hash
from dtk.config.schema import TaskConfig
from dtk.data.batch import batch_size, micro_batches
from dtk.data.loader import StepBatches, build_splits
from dtk.mesh.mesh import ParallelMesh
from dtk.plan.plan import Plan, make_plan
from dtk.train.evaluate import Evaluator
from dtk.train.loss import TokenCrossEntropy
from dtk.train.task import LmTask, build_task
from dtk.train.trainer import Trainer

NO_AUTOCAST = contextlib.nullcontext()


# --- a user's pieces, named by dotted path from the configs below --------------------------


class Points:
    """Item i: (2 features, label): the label is which feature is larger."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(n, 2)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], np.int64(self.x[i, 0] > self.x[i, 1])


def points(n: int = 64) -> Points:
    return Points(n)


def dict_points(n: int = 64) -> list[dict]:
    return [{"x": torch.from_numpy(x), "y": torch.tensor(int(y))} for x, y in (Points(n)[i] for i in range(n))]


def ce(outputs, batch):
    labels = batch["y"] if isinstance(batch, dict) else batch[1]
    return F.cross_entropy(outputs, labels)


def accuracy(outputs, batch):
    return (outputs.argmax(-1) == batch[1]).float().mean()


def ce_of_model(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def per_sample(outputs, batch):
    return F.cross_entropy(outputs, batch[1], reduction="none")


def linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(2, 2)


# --- the task itself ------------------------------------------------------------------------


def test_lm_task_is_next_token_cross_entropy_of_the_loss_component():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    rows = torch.randint(0, 16, (4, 9))
    task = build_task(TaskConfig(), loss=TokenCrossEntropy())
    assert isinstance(task, LmTask)
    want = F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())
    assert torch.equal(task(model, rows, NO_AUTOCAST), want)
    sums, counts = task.sums(model, rows)
    assert counts == {"loss": 4 * 8} and torch.allclose(sums["loss"] / counts["loss"], want)


def test_user_task_forms_and_batch_structures():
    model, tuple_batch = linear(), micro_batches(
        tuple(torch.as_tensor(np.stack(c)) for c in zip(*(points()[i] for i in range(8)), strict=True)), 8
    )[0]
    want = F.cross_entropy(model(tuple_batch[0]), tuple_batch[1])
    on_outputs = build_task(TaskConfig(_target_="test_task.ce"), loss=TokenCrossEntropy())
    on_model = build_task(TaskConfig(_target_="test_task.ce_of_model", form=TaskForm.model), loss=TokenCrossEntropy())
    assert torch.equal(on_outputs(model, tuple_batch, NO_AUTOCAST), want)
    assert torch.equal(on_model(model, tuple_batch, NO_AUTOCAST), want)
    dict_batch = {"x": tuple_batch[0], "y": tuple_batch[1]}
    by_key = build_task(TaskConfig(_target_="test_task.ce", inputs="x"), loss=TokenCrossEntropy())
    assert torch.equal(by_key(model, dict_batch, NO_AUTOCAST), want)
    # Metrics are means over the micro-batch, summed with its size for an exact average.
    with_metric = build_task(TaskConfig(_target_="test_task.ce", metrics={"accuracy": "test_task.accuracy"}),
                             loss=TokenCrossEntropy())
    sums, counts = with_metric.sums(model, tuple_batch)
    assert counts == {"loss": 8, "accuracy": 8}
    assert torch.allclose(sums["loss"], want * 8)
    assert sums["accuracy"] == (model(tuple_batch[0]).argmax(-1) == tuple_batch[1]).sum()


def test_user_task_mistakes_are_one_line_errors():
    model = linear()
    batch = (torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))
    with pytest.raises(UserError, match=r"task._target_=test_task.per_sample returned a tensor of shape \(4,\)"):
        build_task(TaskConfig(_target_="test_task.per_sample"), loss=TokenCrossEntropy())(model, batch, NO_AUTOCAST)
    with pytest.raises(UserError, match="task.inputs=5: the batch is a tuple of 2"):
        build_task(TaskConfig(_target_="test_task.ce", inputs="5"), loss=TokenCrossEntropy())(model, batch, NO_AUTOCAST)
    with pytest.raises(UserError, match="task._target_=test_task.nothing: cannot import it"):
        build_task(TaskConfig(_target_="test_task.nothing"), loss=TokenCrossEntropy())
    with pytest.raises(UserError, match="task.metrics.loss"):
        build_task(TaskConfig(_target_="test_task.ce", metrics={"loss": "test_task.ce"}), loss=TokenCrossEntropy())


def test_batches_of_any_structure_are_cut_into_micro_batches():
    batch = {"x": torch.arange(12).reshape(6, 2), "pair": (torch.arange(6), torch.ones(6)), "name": list("abcdef")}
    micro = micro_batches(batch, 2)
    assert [batch_size(m) for m in micro] == [2, 2, 2]
    assert micro[1]["x"].tolist() == [[4, 5], [6, 7]] and micro[2]["name"] == ["e", "f"]
    assert micro[2]["pair"][0].tolist() == [4, 5]
    with pytest.raises(ValueError, match="different lengths"):
        batch_size((torch.zeros(3), torch.zeros(4)))


# --- configured: compose, plan, loader, trainer, evaluator ---------------------------------

USER_JOB = ["data=user", "data._target_=test_task.points", "+data.kwargs.n=64", "data.val_fraction=0.25",
            "task._target_=test_task.ce", "+task.metrics.accuracy=test_task.accuracy"]


def test_user_data_and_task_compose_plan_and_round_trip():
    cfg = compose(USER_JOB)
    assert cfg.data.kwargs == {"n": 64} and cfg.task.metrics == {"accuracy": "test_task.accuracy"}
    plan = make_plan(cfg)
    again = Plan.from_json(plan.to_json()).config
    assert again.data == cfg.data and again.task == cfg.task
    # task=lm leaves the run's name as it was; a user's loss makes another run.
    assert identity_hash(compose([])) == identity_hash(compose(["+task.metrics.x=a.b"]))
    assert identity_hash(compose(["task._target_=a.b"])) != identity_hash(compose([]))


def test_a_pipeline_refuses_a_task_other_than_the_token_lm():
    with pytest.raises(UserError, match=r"scheme.pp=2 with task._target_=test_task.ce: a pipeline runs the token-LM"):
        make_plan(compose(["+scheme=pp", "tasks_per_node=2", "task._target_=test_task.ce"]))


@pytest.mark.slow
def test_a_user_task_trains_and_evaluates_with_its_metric():
    cfg = compose(USER_JOB)
    train, val = build_splits(cfg.data, model=cfg.model)
    assert (len(train), len(val)) == (48, 16) and train.split.source == "val_fraction"
    model = linear()
    task = build_task(cfg.task, loss=TokenCrossEntropy())
    batches = StepBatches(train, seed=0, global_batch=16, micro_batch=8, dp_rank=0, dp_size=1, device=torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    trainer = Trainer(model=model, optimizer=optimizer, scheduler=scheduler, batches=batches, task=task,
                      grad_clip=0.0, mesh=ParallelMesh.single())
    evaluator = Evaluator(model=model, dataset=val, task=task, every=1, total_steps=30, max_samples=0, global_batch=16,
                          micro_batch=8, mesh=ParallelMesh.single(), device=torch.device("cpu"), log=None,
                          stop_requested=None, autocast_dtype=None)
    before = evaluator.evaluate()
    losses = [trainer.step(step).loss for step in range(30)]
    after = evaluator.evaluate()
    batches.close()
    assert set(before) == {"val_loss", "val_accuracy"}
    assert after["val_loss"] < before["val_loss"] and after["val_accuracy"] > before["val_accuracy"]
    assert losses[-1] < losses[0]
