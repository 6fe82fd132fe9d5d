"""Does DNS announce a Slurm controller here? One SRV question, asked the way Slurm asks it.

A configless Slurm client (no slurm.conf, no SLURM_CONF) finds its controller through the
SRV record `_slurmctld._tcp`, looked up with the resolver's search list. A machine that
gets an answer belongs to a cluster, and a slurm.conf written by the lab would silently
take that cluster's place for every sbatch typed here. The standard library has no SRV
lookup, hence this small client: one UDP query per name and server, short timeouts, and
no answer (no server, no network) means no record, as it does for Slurm itself.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

SLURMCTLD_SRV = "_slurmctld._tcp"
TYPE_SRV = 33
CLASS_IN = 1


def resolver_config(text: str) -> tuple[list[str], list[str]]:
    """(name servers, search domains) from resolv.conf text; the last `search` or
    `domain` line wins, as in the C resolver."""
    servers: list[str] = []
    search: list[str] = []
    for line in text.splitlines():
        words = line.split("#", 1)[0].split(";", 1)[0].split()
        if len(words) >= 2 and words[0] == "nameserver":
            servers.append(words[1])
        elif len(words) >= 2 and words[0] in ("search", "domain"):
            search = words[1:]
    return servers[:3], search  # the resolver asks at most three


def query(name: str) -> bytes:
    labels = b"".join(bytes([len(part)]) + part.encode("ascii") for part in name.rstrip(".").split("."))
    header = struct.pack(">HHHHHH", os.getpid() & 0xFFFF, 0x0100, 1, 0, 0, 0)  # recursion desired
    return header + labels + b"\0" + struct.pack(">HH", TYPE_SRV, CLASS_IN)


def _read_name(message: bytes, offset: int) -> tuple[str, int]:
    """A possibly compressed domain name at `offset`, and the offset just past it."""
    labels: list[str] = []
    end: int | None = None
    jumps = 0
    while True:
        length = message[offset]
        if length & 0xC0 == 0xC0:  # a pointer to a name earlier in the message
            if end is None:
                end = offset + 2
            offset = ((length & 0x3F) << 8) | message[offset + 1]
            jumps += 1
            if jumps > 20:
                raise ValueError("a name pointer loop")
            continue
        if length == 0:
            return ".".join(labels), (end if end is not None else offset + 1)
        labels.append(message[offset + 1 : offset + 1 + length].decode("ascii", "replace"))
        offset += 1 + length


def parse_srv_answer(message: bytes) -> list[str]:
    """`target:port` of each SRV record in a reply; empty for "no such name" (or another
    error code) and for a name without SRV records."""
    _, flags, num_questions, num_answers, _, _ = struct.unpack(">HHHHHH", message[:12])
    if flags & 0x000F:
        return []
    offset = 12
    for _ in range(num_questions):
        offset = _read_name(message, offset)[1] + 4
    found = []
    for _ in range(num_answers):
        offset = _read_name(message, offset)[1]
        rtype, _, _, rdlength = struct.unpack(">HHIH", message[offset : offset + 10])
        offset += 10
        if rtype == TYPE_SRV:
            _, _, port = struct.unpack(">HHH", message[offset : offset + 6])
            target = _read_name(message, offset + 6)[0]
            found.append(f"{target}:{port}")
        offset += rdlength
    return found


def _ask(server: str, name: str, timeout_s: float) -> list[str] | None:
    """The SRV targets `server` gives for `name`; None when it does not answer."""
    family = socket.AF_INET6 if ":" in server else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.sendto(query(name), (server, 53))
            reply, _ = sock.recvfrom(4096)
        except OSError:  # unreachable, refused, timed out
            return None
    try:
        return parse_srv_answer(reply)
    except (ValueError, struct.error, IndexError):
        return None


def slurmctld_records(resolv_conf: Path, *, budget_s: float = 2.0) -> tuple[str, list[str]] | None:
    """(name, targets) of the first `_slurmctld._tcp` SRV record the resolver would find,
    or None. Spends at most about `budget_s` on servers that do not answer."""
    try:
        servers, search = resolver_config(resolv_conf.read_text())
    except FileNotFoundError:
        servers, search = [], []
    # The name has one dot, as many as the resolver's default ndots: it is tried as
    # given first, then with each search domain.
    names = [SLURMCTLD_SRV] + [f"{SLURMCTLD_SRV}.{domain}" for domain in search]
    deadline = time.monotonic() + budget_s
    for name in names:
        for server in servers or ["127.0.0.1"]:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            targets = _ask(server, name, min(0.5, left))
            if targets:
                return name, targets
            if targets is not None:
                break  # the server answered for this name: the next server would agree
    return None
