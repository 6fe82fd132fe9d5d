"""Phase timings of real training on 2 gloo ranks: the trainer, DDP, the step profiler and
the metrics log as the worker wires them, in three runs: a plain one, one with a slow data
source, and one in which rank 1 sleeps in every forward. One start of the ranks runs all
three (the arithmetic alone: test_phases.py).

The comparisons hold on a loaded machine by construction: every forward on every rank
waits DEVICE_S (the time an accelerator would take; a sleep, which CPU contention does not
stretch), so the tiny model's CPU time is a small part of a step, and the injected delays
are several times a step. Twice the CPU time on one rank moves a plain run's busy ratio
well under the straggler factor, and leaves a slow read far above the step it hides
behind."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dtk.common.rundir import IDLE_PHASES, PHASES, RunDir, read_jsonl
from dtk.data.loader import StepBatches
from dtk.data.synthetic import SyntheticTokens
from dtk.mesh.mesh import build_mesh
from dtk.models.transformer import build
from dtk.plan.degrees import Degrees
from dtk.train.loss import TokenCrossEntropy
from dtk.train.metrics import MetricsLog
from dtk.train.policies import StepPolicies
from dtk.train.profile import StepProfiler
from dtk.train.task import LmTask
from dtk.train.trainer import Trainer
from multirank import run_on_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # the module's runs train 2 gloo ranks: seconds
WORLD = 2
STEPS, LOG_EVERY, BATCH, SEQ, VOCAB = 8, 4, 8, 32, 64
DEVICE_S = 0.03  # every forward on every rank: the device's share of a step
SLOW_DATA_S = 0.25  # per batch read: several steps' worth, the loader cannot keep up
SLEEP_S = 0.2  # rank 1's extra time in every forward
FACTOR = 2.0  # fault.straggler_factor: a rank 2x the other's busy time is flagged


class SlowData:
    """A data source that takes SLOW_DATA_S per read (a slow file system, say)."""

    def __init__(self, inner: SyntheticTokens) -> None:
        self.inner, self.version = inner, inner.version

    def __len__(self) -> int:
        return len(self.inner)

    def get(self, ids):
        time.sleep(SLOW_DATA_S)
        return self.inner.get(ids)


class Sleepy(torch.nn.Module):
    """The model, slower by `seconds` in every forward: the device's time, and for the
    straggler a slow GPU or a busy host."""

    def __init__(self, inner: torch.nn.Module, seconds: float) -> None:
        super().__init__()
        self.inner, self.seconds = inner, seconds

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.inner(tokens)


class Nothing:
    def after_step(self, step: int, result: Any = None) -> None:
        pass


class OutsideClock:
    """The profile policy, and a wall clock around it: from after one step's profile policy
    (an interval's read and write) to before the next's is that step, whole."""

    def __init__(self, inner: StepProfiler) -> None:
        self.inner, self.seconds, self._last = inner, {}, time.perf_counter()

    def after_step(self, step: int, result: Any = None) -> None:
        self.seconds[step] = time.perf_counter() - self._last
        self.inner.after_step(step, result)
        self._last = time.perf_counter()

    def flush(self) -> None:
        self.inner.flush()


def one_run(rank: int, folder: Path, *, slow_data: bool, sleep_on_rank1: bool) -> dict[str, Any]:
    run = RunDir(folder)
    folder.mkdir(parents=True, exist_ok=True)
    mesh = build_mesh(Degrees(dp_replicate=1, pp=1, dp_shard=WORLD, tp=1), "cpu")
    torch.manual_seed(0)
    model = build(vocab_size=VOCAB, dim=64, num_layers=2, num_heads=4, seq_len=SEQ)
    model = Sleepy(model, DEVICE_S + (SLEEP_S if sleep_on_rank1 and rank == 1 else 0.0))
    model = torch.nn.parallel.DistributedDataParallel(model)
    data = SyntheticTokens(num_samples=256, seq_len=SEQ, vocab_size=VOCAB, seed=0, branching=2)
    batches = StepBatches(SlowData(data) if slow_data else data, seed=0, global_batch=BATCH, micro_batch=BATCH // WORLD,
                          dp_rank=mesh.dp_rank, dp_size=mesh.dp_size, device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    metrics = MetricsLog(run.metrics if rank == 0 else None, world_size=WORLD, restart=0, global_batch=BATCH,
                         tokens_per_step=BATCH * SEQ, total_steps=STEPS, log_every=LOG_EVERY,
                         samples_per_epoch=len(data), flops_per_token=None, peak_tflops=None)
    profile = StepProfiler(device=torch.device("cpu"), enabled=True, straggler_factor=FACTOR,
                           run=run if rank == 0 else None, rank=rank, log_every=LOG_EVERY, total_steps=STEPS,
                           metrics=metrics, saving=None)
    trainer = Trainer(model=model, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                      batches=batches, task=LmTask(TokenCrossEntropy()), grad_clip=1.0, mesh=mesh,
                      timer=profile.timer)
    policies = StepPolicies(metrics=metrics, heartbeat=Nothing(), resumed=Nothing(), evaluation=Nothing(),
                            checkpoint=Nothing(), stop=Nothing(), profile=OutsideClock(profile))
    dist.barrier()
    policies.profile._last = time.perf_counter()
    trainer.fit(start_step=0, total_steps=STEPS, policies=policies)
    metrics.close()
    batches.close()
    profile.close()
    if rank != 0:
        return {}
    return {"records": list(read_jsonl(run.metrics)), "events": run.events_list(), "outside": policies.profile.seconds}


def runs(rank: int, world: int, folder: str) -> dict[str, Any]:
    out = {}
    for name, slow_data, sleep_on_rank1 in (("plain", False, False), ("slow_data", True, False),
                                            ("straggler", False, True)):
        out[name] = one_run(rank, Path(folder) / name, slow_data=slow_data, sleep_on_rank1=sleep_on_rank1)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("phases")
    return run_on_ranks(runs, WORLD, folder, str(folder))[0]


def test_every_record_has_phases_that_add_up_to_the_step_time(results):
    for name in ("plain", "slow_data", "straggler"):
        records = results[name]["records"]
        assert [r["step"] for r in records] == list(range(1, STEPS + 1)), name
        for r in records:
            assert set(r["phases"]) == set(PHASES), (name, r)
            assert sum(r["phases"].values()) == pytest.approx(r["step_time_s"], rel=0.05), (name, r)
            assert 0 <= r["idle_share"] <= 1
            idle = sum(r["phases"][p] for p in IDLE_PHASES) / r["step_time_s"]
            assert r["idle_share"] == pytest.approx(idle, abs=1e-3)
        # The step time is the whole step: a wall clock read outside the loop agrees.
        inside = sum(r["step_time_s"] for r in records)
        outside = sum(results[name]["outside"].values())
        assert inside == pytest.approx(outside, rel=0.05), name
        # Once per interval, every rank's times (and hosts) on the interval's last record.
        with_ranks = [r["step"] for r in records if "ranks" in r]
        assert with_ranks == [LOG_EVERY, 2 * LOG_EVERY]
        assert len(records[-1]["ranks"]["step_time_s"]) == WORLD and len(records[-1]["ranks"]["hosts"]) == WORLD


def _median(records, phase: str) -> float:
    return statistics.median(r["phases"][phase] for r in records[1:])  # step 1 warms up


def test_a_slow_data_source_shows_as_data_the_main_idle_part(results):
    records = results["slow_data"]["records"]
    data = _median(records, "data")
    others = {p: _median(records, p) for p in IDLE_PHASES if p != "data"}
    assert all(data > v for v in others.values()), (data, others)
    # The loader reads ahead in a thread, so the wait is what the read takes beyond the rest
    # of the step (which a loaded machine stretches): at least half of that.
    rest = statistics.median(r["step_time_s"] - r["phases"]["data"] for r in records[1:])
    assert data > (SLOW_DATA_S - rest) / 2, (data, rest)
    plain = results["plain"]["records"]
    assert data > 5 * _median(plain, "data")
    assert not [e for e in results["slow_data"]["events"] if e["event"] == "straggler"]


def test_a_rank_that_sleeps_is_flagged_and_the_others_wait_for_it(results):
    records = results["straggler"]["records"]
    # Rank 0 (which logs) waits for rank 1 at the gradient reduction: its straggler phase.
    assert _median(records, "straggler") > SLEEP_S / 2
    assert _median(records, "straggler") > 3 * _median(results["plain"]["records"], "straggler")
    flagged = [e for e in results["straggler"]["events"] if e["event"] == "straggler"]
    assert [(e["step"], e["rank"]) for e in flagged] == [(LOG_EVERY, 1), (2 * LOG_EVERY, 1)]  # every interval
    assert all(e["host"] and e["ratio"] > FACTOR for e in flagged)
    ranks = records[-1]["ranks"]
    assert ranks["busy_s"][1] > ranks["busy_s"][0]
    # Per rank, where the time goes: rank 1's forward is the slow part, rank 0 waits.
    assert ranks["forward_s"][1] > ranks["forward_s"][0] + SLEEP_S / 2
    assert ranks["straggler_s"][0] > SLEEP_S / 2 > ranks["straggler_s"][1]
    assert not [e for e in results["plain"]["events"] if e["event"] == "straggler"]
