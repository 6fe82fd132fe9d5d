"""The tracker clients behind dtk.train.tracker's sinks: MLflow and W&B, imported only in
rank 0's tracker threads (never on the login node, which checks only that they exist).

What a tracker run holds, for both:
- its name: the dtk run's name (the run directory's); the run directory's path as the tag
  `dtk.run_dir` (MLflow; W&B: config key `dtk.run_dir` and the run's notes); the Slurm job
  ids of every start, each added as it comes (MLflow tag `dtk.job_ids`, comma-separated;
  W&B tags `job-<id>`);
- params: the resolved configuration, flattened (`train.steps`, `model.dim`, ...). MLflow
  params cannot change: a key a later submission changed (a key outside the run's identity)
  is set as the tag `config.<key>` with its new value;
- metrics: the scalars of metrics.jsonl with its names (`loss`, `lr`, `grad_norm`,
  `phases/forward`, ...; dtk.train.tensorboard.scalars) at their steps.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtk.config.choices import Tracker
from dtk.train.tensorboard import scalars

DEFAULT_PROJECT = "dtk"  # MLflow experiment and W&B project without MLFLOW_EXPERIMENT_NAME / WANDB_PROJECT
RUN_DIR_TAG = "dtk.run_dir"
JOB_IDS_TAG = "dtk.job_ids"
PARAM_KEY = re.compile(r"[^A-Za-z0-9_\-. :/]")  # what MLflow refuses in a key (`model.tp_plan.layers.*.attn`)
MAX_PARAM = 500  # characters of a param's value (MLflow refuses longer ones)
MAX_METRICS = 1000  # MLflow's limit per log_batch


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The resolved configuration as `section.key` -> its value's text (a character MLflow
    refuses in a key, such as `*`, becomes `_`)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[PARAM_KEY.sub("_", f"{prefix}{key}")] = str(value)[:MAX_PARAM]
    return out


class MlflowRun:
    """One MLflow run per dtk run, through MlflowClient (any tracking URI)."""

    name = str(Tracker.mlflow)

    def __init__(self, *, uri: str | None, run_dir: Path, params: dict[str, str]) -> None:
        self.uri = uri
        self.run_dir = run_dir
        self.params = params
        self.client: Any = None
        self.run_id = ""

    def open(self, run_id: str | None, job_ids: list[str], remember: Callable[[str], None]) -> tuple[str, int | None]:
        # dtk's sink retries with backoff itself: the client's own retries (minutes, by
        # default) would only hold the buffer back.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        if not run_id:
            run_id = self._find(client) or self._create(client)
            remember(run_id)
        run = client.get_run(run_id)
        held = run.data.params
        jobs = [j for j in run.data.tags.get(JOB_IDS_TAG, "").split(",") if j]
        jobs += [j for j in job_ids if j not in jobs]
        tags = [RunTag(JOB_IDS_TAG, ",".join(jobs))] if jobs else []
        tags += [RunTag(f"config.{k}", v) for k, v in self.params.items() if k in held and held[k] != v]
        params = [Param(k, v) for k, v in self.params.items() if k not in held]
        for i in range(0, max(len(params), len(tags), 1), 100):
            client.log_batch(run_id, params=params[i:i + 100], tags=tags[i:i + 100])
        if run.info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
        steps = [m.step for m in client.get_metric_history(run_id, "loss")]
        self.client, self.run_id = client, run_id
        return run_id, max(steps, default=None)

    def _experiment(self, client: Any) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
        found = client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else client.create_experiment(name)

    def _find(self, client: Any) -> str | None:
        """A run this run directory made whose id never reached tracker.json (a start killed
        between creating it and writing the file)."""
        where = str(self.run_dir)
        if "'" in where:
            return None
        found = client.search_runs([self._experiment(client)], filter_string=f"tags.`{RUN_DIR_TAG}` = '{where}'",
                                   max_results=1)
        return found[0].info.run_id if found else None

    def _create(self, client: Any) -> str:
        run = client.create_run(self._experiment(client), run_name=self.run_dir.name,
                                tags={RUN_DIR_TAG: str(self.run_dir)})
        return run.info.run_id

    def log(self, records: list[dict[str, Any]]) -> None:
        """Whole records per call, in step order: the newest `loss` step the run holds says
        that every metric of that step and before it was taken."""
        from mlflow.entities import Metric

        batch: list[Any] = []
        for record in records:
            metrics = [Metric(key, value, int(1000 * float(record.get("time") or 0)), int(record["step"]))
                       for key, value in scalars(record).items()]
            if batch and len(batch) + len(metrics) > MAX_METRICS:
                self.client.log_batch(self.run_id, metrics=batch)
                batch = []
            batch.extend(metrics)
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self, *, finished: bool) -> None:
        if finished:
            self.client.set_terminated(self.run_id, "FINISHED")


class WandbRun:
    """One W&B run per dtk run: wandb.init with the run's id and resume="allow"; offline
    (WANDB_MODE=offline) each start writes an offline folder of that same id under
    <run dir>/wandb/, which `wandb sync` uploads as the one run."""

    name = str(Tracker.wandb)

    def __init__(self, *, run_dir: Path, params: dict[str, str]) -> None:
        self.run_dir = run_dir
        self.params = params
        self.run: Any = None

    def open(self, run_id: str | None, job_ids: list[str], remember: Callable[[str], None]) -> tuple[str, int | None]:
        import wandb

        if run_id is None:
            run_id = uuid.uuid4().hex[:16]  # W&B ids: letters and digits
            remember(run_id)  # before wandb.init, which takes seconds
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT, id=run_id, resume="allow",
            name=self.run_dir.name, notes=str(self.run_dir), dir=str(self.run_dir),
            tags=[f"job-{j}" for j in job_ids], settings=wandb.Settings(console="off", silent=True),
        )
        # A key a later submission changed (outside the run's identity) takes its new value.
        self.run.config.update({**self.params, RUN_DIR_TAG: str(self.run_dir)}, allow_val_change=True)
        return run_id, None

    def log(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self.run.log(scalars(record), step=int(record["step"]))

    def close(self, *, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


def clients(trackers: tuple[Tracker, ...], *, mlflow_uri: str | None, run_dir: Path,
            config: dict[str, Any]) -> list[Any]:
    """The clients of train.tracker that log through a sink (TensorBoard writes local files
    in the metrics thread, dtk.train.tensorboard)."""
    params = flat_params(config)
    made: list[Any] = []
    for tracker in trackers:
        if tracker == Tracker.mlflow:
            made.append(MlflowRun(uri=mlflow_uri, run_dir=run_dir, params=params))
        elif tracker == Tracker.wandb:
            made.append(WandbRun(run_dir=run_dir, params=params))
    return made
