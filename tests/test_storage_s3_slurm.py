"""A Slurm job whose checkpoints go to an object store (`checkpoint.dir=s3://BUCKET/PREFIX`,
moto's S3 server on 127.0.0.1, which the lab's nodes share): preempted for real with
`python -m dtk.drill preempt`, its driver on the batch host sees the checkpoint the workers
committed in the bucket, requeues the job, and the next start resumes from the bucket with no
step lost or repeated and the losses of the uninterrupted run. The job gets the store's
endpoint and credentials as the submitting shell's AWS_* variables (sbatch exports them)."""

from __future__ import annotations

import json

import pytest
from test_faults import LAB, drill, finish, named, requeued_once_and_resumed, step_reached, wait_for

from conftest import dtk, losses, new_bucket, only_run_dir
from dtk.common.storage import checkpoint_steps, open_storage

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_a_preempted_slurm_job_requeues_on_its_s3_checkpoint_and_resumes_from_it(lab, s3, tmp_path, lab_reference):
    url = f"s3://{new_bucket()}/team/ckpts"
    proc = dtk("dtk.submit", *LAB, f"checkpoint.dir={url}", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = proc.stdout.split("submitted job ", 1)[1].split()[0]
    run = only_run_dir(tmp_path)
    wait_for(lambda: step_reached(run, 60), 180, "step 60")
    drill("preempt", run, "--hold", "5")
    summary = finish(job, run)
    assert summary["status"] == "finished", summary

    preempted = requeued_once_and_resumed(run, job)
    assert preempted["step"] > 0
    loaded = named(run, "checkpoint_loaded")[-1]
    assert loaded["step"] == preempted["step"] and loaded["path"] == f"{url}/{run.name}/step_{loaded['step']:08d}"
    assert losses(run) == lab_reference

    store = open_storage(url).child(run.name)
    committed = [step for step, _, ok in checkpoint_steps(store) if ok]
    assert committed and max(committed) == summary["final_step"], committed
    assert not list((run / "checkpoints").glob("step_*"))  # nothing on the run directory's disk
    # The secret reached the job by its environment only: no file of the run root holds it
    # (the batch script, submitit's pickles and logs, events, the audit log).
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name.endswith("_submission.sh") for p in files), sorted(map(str, files))
    assert not [p for p in files if s3["AWS_SECRET_ACCESS_KEY"].encode() in p.read_bytes()]
    status = json.loads(dtk("dtk.status", str(run), "--json").stdout)
    assert status["last_checkpoint"] == max(committed), status
