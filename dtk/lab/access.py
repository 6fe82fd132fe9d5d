"""`python -m dtk.lab up --access FILE`: the lab's Slurm enforces an access policy.

Every partition admits only the submitter group (AllowGroups), so a user outside it is
refused by Slurm itself, also with plain sbatch. When the policy charges submitters to an
account, the lab runs accounting (dtk.lab.accounting) and the partitions admit only that
account (AllowAccounts; AccountingStorageEnforce=associations refuses users without one).
Root and SlurmUser are not subject to AllowGroups, and the partitions also allow the account
root, so the lab's own use as root goes on.

The config is re-rendered from the template each time (`with_access` is pure); what is
in force is kept in `access.json` in the lab directory, for `lab status` and for the next
`up`. An `up` without --access on a running lab (to restart a dead slurmd, say) keeps its
policy and says so; `--access open` puts back the plain config; a lab that was down starts
open.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from dtk.access.policy import enforced, group_members, load_policy
from dtk.config.access import AccessConfig
from dtk.lab import accounting, daemons, files
from dtk.lab.files import LabLayout, SystemFiles
from dtk.lab.programs import LabError, Log, program, slurm
from dtk.lab.record import LabRecord, read_record, write_record
from dtk.lab.start import log_file, startup_log, wait_for_nodes

# Group membership is re-read this often (seconds), and even when /etc/group looks
# unchanged, so that a user removed from the submitter group is refused within seconds.
GROUP_UPDATE_S = 10


def with_access(conf: str, policy: AccessConfig, *, accounts: bool) -> str:
    """The lab's slurm.conf text with the policy's partition limits (and accounting)."""
    group, account = policy.submitter.group, policy.submitter.account
    out = []
    for line in conf.splitlines():
        if line.startswith("PartitionName="):
            # Account root stays allowed: the lab's own use as root (tests, drills) goes on.
            line += f" AllowGroups={group}" + (f" AllowAccounts={account},root" if accounts and account else "")
        elif accounts and line.startswith("AccountingStorageType="):
            out += ["# Accounting (python -m dtk.lab up --access): slurmdbd and MariaDB on this machine.",
                    *accounting.CONF_LINES]
            continue
        out.append(line)
    out += ["", f"# Access policy {policy.name} (python -m dtk.lab up --access): partitions admit group {group}"
                + (f" and account {account}" if accounts and account else "") + " only.",
            f"GroupUpdateTime={GROUP_UPDATE_S}", "GroupUpdateForce=1"]
    return "\n".join(out) + "\n"


def state_file(layout: LabLayout) -> Path:
    return layout.access_state


def current(layout: LabLayout) -> dict | None:
    """What `apply` put in force: policy name, file, group, account; None when nothing."""
    try:
        return json.loads(state_file(layout).read_text())
    except FileNotFoundError:
        return None


def describe(layout: LabLayout) -> str:
    state = current(layout)
    if state is None:
        return "access: open (no --access policy; every user may submit)"
    account = f", account {state['account']} (accounting on)" if state.get("account") else ""
    return f"access: policy {state['policy']} from {state['file']}: partitions admit group {state['group']}{account}"


def kept(asked: str | None, *, state: dict | None, log: Log) -> str | None:
    """The policy `up` puts in force: the one asked for; without --access, the one the
    running lab had (`state`, read before `up`), so that an `up` that restarts a node, or
    the whole lab, opens no partition."""
    if asked is not None:
        return asked
    if state is None:
        return None
    log(f"access: the lab keeps policy {state['policy']} ({state['file']}); python -m dtk.lab up --access open"
        " admits every user again")
    return state["file"]


def apply(policy_file: str | None, *, layout: LabLayout, system: SystemFiles, install: bool, timeout_s: float,
          log: Log) -> None:
    """Put the policy of `policy_file` in force on the running lab, or none (the plain
    config) when it is None. The lab must be up (`cluster.up` first)."""
    policy = load_policy(policy_file) if policy_file else None
    if policy is not None and not enforced(policy):
        policy = None  # the open policy: the plain config
    record = read_record(layout)
    if record is None:
        raise LabError("the lab is not up; python -m dtk.lab up starts it")
    was = current(layout)
    if policy is None and was is None:
        return
    submitter = policy.submitter if policy is not None else None
    account = submitter.account if submitter is not None else None
    group = submitter.group if submitter is not None else None  # an enforced policy names it
    wants_accounts = account is not None
    had_accounts = any(d.program == "slurmdbd" for d in record.daemons)  # a restarted lab has none
    if account is not None and group is not None:
        accounting.ensure_installed(install, log)
        group_members(group)  # the group must exist: an error line, not a Slurm log entry
    base = files.render_slurm_conf(layout, record.num_nodes, gpus_per_node=record.num_gpus,
                                   preempt_mode=record.preempt_mode)
    conf = with_access(base, policy, accounts=wants_accounts) if policy else base
    if wants_accounts and not had_accounts:
        record = _add(layout, record, accounting.start(layout, log))
    layout.conf.write_text(conf)
    files.write_system_conf(conf, system.slurm_conf)
    if account is not None and group is not None:
        accounting.associate(system, account=account, users=sorted(group_members(group) | {"root"}))
    if wants_accounts != had_accounts:  # AccountingStorageType is read at the controller's start only
        record = _restart_controller(layout, system, record)
    if had_accounts and not wants_accounts:
        record = _drop(layout, record, ("slurmdbd", "mariadbd"))
    proc = slurm(["scontrol", "reconfigure"], system)
    if proc.returncode != 0:
        raise LabError(f"scontrol reconfigure: {(proc.stderr or proc.stdout).strip()}")
    wait_for_nodes(layout, system, list(record.daemons), record.num_nodes, timeout_s,
                   ready=lambda state: not state.endswith("*") and not state.startswith("down"))
    if policy is None:
        state_file(layout).unlink(missing_ok=True)
        log("access: the lab's partitions admit every user again")
        return
    assert policy_file is not None, "a policy comes from its file"
    state = {"policy": policy.name, "file": str(Path(policy_file).resolve()) if Path(policy_file).is_file()
             else policy_file, "group": policy.submitter.group, "account": policy.submitter.account if
             wants_accounts else None}
    state_file(layout).write_text(json.dumps(state, indent=1))
    log(describe(layout))


def _add(layout: LabLayout, record: LabRecord, started: list[daemons.Daemon]) -> LabRecord:
    record = replace(record, daemons=record.daemons + tuple(started))
    write_record(layout, record)
    return record


def _drop(layout: LabLayout, record: LabRecord, programs: tuple[str, ...]) -> LabRecord:
    gone = [d for d in record.daemons if d.program in programs]
    daemons.stop(list(reversed(gone)))
    record = replace(record, daemons=tuple(d for d in record.daemons if d not in gone))
    write_record(layout, record)
    return record


def _restart_controller(layout: LabLayout, system: SystemFiles, record: LabRecord) -> LabRecord:
    """slurmctld again, with the new config; its state (jobs, nodes) is kept on disk."""
    old = next(d for d in record.daemons if d.program == "slurmctld")
    daemons.stop([old])
    new = daemons.start("slurmctld", [program("slurmctld"), "-f", str(system.slurm_conf)],
                        layout.pid_dir / "slurmctld.pid", output=startup_log(layout),
                        log=log_file(layout, "slurmctld"))
    record = replace(record, daemons=tuple(new if d == old else d for d in record.daemons))
    write_record(layout, record)
    return record
