"""common: what every stage shares, on every host (login node, batch host, every rank).

    errors.py     UserError, the commands' ArgumentParser and run_cli (one `error:` line, exit 2)
    rundir.py     the run directory: every name in it, RunDir, its JSON and JSONL files
    processes.py  a process's identity and liveness (a reused pid is not the process recorded)
    resources.py  the package data (conf/, slurm_templates/) in a checkout and in a wheel
    storage.py    where a run's checkpoints live (its checkpoints/ folder or an object store): every
                  read, write, listing and deletion of checkpoint folders, committed steps included
    audit.py      the run root's audit log: who submitted, stopped, drilled, exported or deleted what
    moved.py      module paths of earlier releases, resolved to today's modules

May import no stage: every stage imports it; stdlib (and psutil, imported where used; fsspec and s3fs
only for an object store's URL, in storage.py) only, no torch.
"""
