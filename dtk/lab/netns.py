"""The lab's nodes in network namespaces (`python -m dtk.lab up --netns`).

Without it every slurmd shares this machine's network stack, so every node has the same
interfaces and addresses, and a job's traffic between "nodes" never leaves the loopback.
With it each node gets a stack of its own:

    root namespace                         namespace dtklab-nodeK
    bridge dtklab0  10.77.0.1/24  <---->   veth lab0  10.77.0.(K+1)/24  (peer dtkv-nodeK)

slurmd runs inside its namespace (daemon_prefix), so its job steps do too; slurmctld
stays in the root namespace and reaches each slurmd at its veth address (NodeAddr), and
the slurmds reach it at the bridge's. munge is a unix socket: the filesystem is shared,
so it needs nothing. Every node names its interface `lab0`, so a job sees one interface
shared by all its nodes, with an address of its own on each, as on a real cluster.

`slow` shapes what a node sends (a token bucket, `tc qdisc ... tbf`, on its `lab0`): a
slow node for the doctor to find. Deleting a namespace deletes its veth pair and the
qdisc with it; `remove` deletes every namespace and link by the lab's names, so it also
cleans what a crashed `up` left.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from dtk.lab.programs import LabError, find_program

BRIDGE = "dtklab0"
NODE_IFACE = "lab0"
SUBNET = "10.77.0"
PREFIX_LEN = 24
NS_PREFIX = "dtklab-"
VETH_PREFIX = "dtkv-"
# A tbf bucket of 64 kB and 100 ms of queue: enough for the rates a lab slows a node to
# (1 mbit to a few gbit) without bursts that hide the limit on small messages.
TBF_BURST = "64kb"
TBF_LATENCY = "100ms"
RATE = re.compile(r"^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)$")


def namespace(node: str) -> str:
    return NS_PREFIX + node


def veth(node: str) -> str:
    return VETH_PREFIX + node


def bridge_address() -> str:
    """Where the slurmds reach slurmctld."""
    return f"{SUBNET}.1"


def node_address(index: int) -> str:
    """nodeK's address on its `lab0`."""
    return f"{SUBNET}.{index + 1}"


def exec_prefix(node: str) -> list[str]:
    """What runs a short command (tc) inside `node`'s namespace."""
    return [_ip(), "netns", "exec", namespace(node)]


# In a mount namespace of its own: this machine's cgroup tree is set aside, a sysfs of the
# node's network namespace mounted on /sys (so /sys/class/net lists the node's interfaces,
# as discovery expects), and the cgroup tree put back under it, where slurmd looks for it
# at start (`ip netns exec` mounts the same sysfs but without /sys/fs/cgroup, and slurmd
# then refuses to start: "No filesystem mounted on /sys/fs/cgroup").
_ENTER = ('mount --rbind /sys/fs/cgroup "$0" && mount -t sysfs sysfs /sys && mount --move "$0" /sys/fs/cgroup'
          ' && exec "$@"')


def daemon_prefix(node: str, hold: Path) -> list[str]:
    """What runs a daemon (slurmd) inside `node`'s network namespace with a /sys of that
    namespace; `hold` is an empty folder, a mount point for a moment."""
    hold.mkdir(parents=True, exist_ok=True)
    missing = [p for p in ("nsenter", "unshare") if find_program(p) is None]
    if missing:
        raise LabError(f"{' and '.join(missing)} not found; --netns needs them: apt-get install util-linux")
    return [find_program("nsenter") or "nsenter", f"--net=/run/netns/{namespace(node)}",
            find_program("unshare") or "unshare", "--mount", "--propagation", "slave", "sh", "-c", _ENTER, str(hold)]


def _ip() -> str:
    path = find_program("ip")
    if path is None:
        raise LabError("the ip program (iproute2) is not installed; --netns needs it: apt-get install iproute2")
    return path


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed: {' '.join(proc.stderr.split()) or f'exit {proc.returncode}'}")
    return proc


def existing() -> tuple[list[str], list[str]]:
    """(namespaces, links) of the lab's that exist now: its names only."""
    if find_program("ip") is None:
        return [], []
    names = [line.split()[0] for line in _run([_ip(), "netns", "list"], check=False).stdout.splitlines() if line.strip()]
    links_out = _run([_ip(), "-j", "link", "show"], check=False).stdout
    links = [link["ifname"] for link in json.loads(links_out or "[]")]
    return (sorted(n for n in names if n.startswith(NS_PREFIX)),
            sorted(ln for ln in links if ln == BRIDGE or ln.startswith(VETH_PREFIX)))


def foreign_addresses() -> list[str]:
    """Addresses in the lab's subnet on this machine that are not the lab bridge's: a
    network the lab would shadow."""
    out = _run([_ip(), "-j", "-4", "addr", "show"], check=False).stdout
    found = []
    for link in json.loads(out or "[]"):
        for addr in link.get("addr_info", []):
            if link["ifname"] != BRIDGE and addr.get("local", "").startswith(SUBNET + "."):
                found.append(f"{addr['local']} on {link['ifname']}")
    return found


def owner() -> str | None:
    """The lab folder whose `up` made the bridge (kept as the bridge's alias), or None
    when there is no bridge. Only that lab's `down` removes the network."""
    if find_program("ip") is None:
        return None
    proc = _run([_ip(), "-j", "link", "show", "dev", BRIDGE], check=False)
    if proc.returncode != 0:
        return None
    (link,) = json.loads(proc.stdout)
    return link.get("ifalias", "")


def create(nodes: list[str], *, lab_root: str) -> None:
    """The bridge and one namespace per node, each with its veth address; removes first
    whatever a previous run of this lab left."""
    made_by = owner()
    if made_by is not None and made_by != lab_root:
        raise LabError(f"the bridge {BRIDGE} belongs to the lab in {made_by or 'an unknown folder'}; stop that lab"
                       f" (DTK_LAB_DIR={made_by} python -m dtk.lab down) or delete it (ip link del {BRIDGE})")
    remove()
    clash = foreign_addresses()
    if clash:
        raise LabError(f"--netns uses {SUBNET}.0/{PREFIX_LEN}, but this machine already has {', '.join(clash)};"
                       " run the lab without --netns")
    ip = _ip()
    _run([ip, "link", "add", BRIDGE, "type", "bridge"])
    _run([ip, "link", "set", BRIDGE, "alias", lab_root])
    _run([ip, "addr", "add", f"{bridge_address()}/{PREFIX_LEN}", "dev", BRIDGE])
    _run([ip, "link", "set", BRIDGE, "up"])
    for index, node in enumerate(nodes, start=1):
        ns = namespace(node)
        _run([ip, "netns", "add", ns])
        _run([ip, "link", "add", veth(node), "type", "veth", "peer", "name", NODE_IFACE, "netns", ns])
        _run([ip, "link", "set", veth(node), "master", BRIDGE, "up"])
        _run([ip, "-n", ns, "addr", "add", f"{node_address(index)}/{PREFIX_LEN}", "dev", NODE_IFACE])
        _run([ip, "-n", ns, "link", "set", "lo", "up"])
        _run([ip, "-n", ns, "link", "set", NODE_IFACE, "up"])
        # No route beyond the bridge: nothing outside answers in a namespace (the machine's
        # name server included), and without a route a lookup fails at once instead of
        # waiting 10 s for it (torch's store looks up the address of every connection).


def remove() -> list[str]:
    """Delete the lab's namespaces, veths and bridge (their qdiscs go with them); what was
    removed. Idempotent; call it only once no process of the lab runs in a namespace."""
    namespaces, links = existing()
    for ns in namespaces:
        _run([_ip(), "netns", "del", ns], check=False)
    for link in links:  # a veth whose namespace went is gone already; a bridge is not
        _run([_ip(), "link", "del", link], check=False)
    left_ns, left_links = existing()
    if left_ns or left_links:
        raise LabError("could not remove the lab's network namespaces/links: " + ", ".join(left_ns + left_links))
    return namespaces + [ln for ln in links if ln == BRIDGE]


def check_rate(rate: str) -> str:
    if not RATE.match(rate):
        raise LabError(f"rate {rate!r}: give a tc rate such as 100mbit, 1gbit or 500kbit, or off")
    return rate


def slow(node: str, rate: str | None) -> None:
    """Limit what `node` sends to `rate` (a tc rate, `100mbit`), or lift the limit (None)."""
    argv = [*exec_prefix(node), find_program("tc") or "tc", "qdisc"]
    if rate is None:
        proc = _run([*argv, "del", "dev", NODE_IFACE, "root"], check=False)
        if proc.returncode != 0 and "No such file" not in proc.stderr and "Cannot delete" not in proc.stderr:
            raise LabError(f"could not lift the limit on {node}: {' '.join(proc.stderr.split())}")
        return
    _run([*argv, "replace", "dev", NODE_IFACE, "root", "tbf", "rate", check_rate(rate), "burst", TBF_BURST,
          "latency", TBF_LATENCY])


def qdisc(node: str) -> str:
    """`tc qdisc show` of the node's interface, one line (for status)."""
    proc = _run([*exec_prefix(node), find_program("tc") or "tc", "qdisc", "show", "dev", NODE_IFACE], check=False)
    return " ".join(proc.stdout.split())
