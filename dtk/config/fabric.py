"""The schemas of the `fabric`, `doctor` and `plan` sections: the network a job checks and
the what-if inputs of the memory budget (part of dtk/config/schema.py, which imports them;
kept here to keep each module short)."""

from __future__ import annotations

from dataclasses import dataclass

from dtk.config.choices import FabricRequire

# The variables dtk may choose at start (dtk.topology.choose); one of them set by hand in
# cluster.env is taken as the user's word. The plan's handout lists those the user fixed.
CHOSEN_KEYS = ("NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME",
               "GLOO_SOCKET_IFNAME", "MASTER_ADDR")


@dataclass
class FabricConfig:
    require: FabricRequire = FabricRequire.auto
    """Transport check at start (NCCL): `auto` stops the job when a node has InfiniBand / RoCE but NCCL chose TCP sockets, `ib` also when a node has no RDMA port or the report is missing, `any` accepts sockets."""
    detect: bool = True
    """Discover each node at start and set NCCL / gloo interfaces and the master address from it (topology.json). False: leave them to NCCL, gloo and the environment."""


@dataclass
class DoctorConfig:
    min_mb: float = 1.0
    """Smallest all-reduce message of the doctor's sweep, in MB."""
    max_mb: float = 1024.0
    """Largest all-reduce message of the sweep, in MB (1 GB, as nccl-tests sweeps); capped by max_mb_cpu on the CPU."""
    max_mb_cpu: float = 64.0
    """Largest message on the CPU (gloo): a 1 GB gloo sweep on a small machine takes minutes and its memory."""
    repeats: int = 5
    """Timed repetitions per message size (after one warm-up); the median is reported."""
    p2p_mb: float = 64.0
    """Message size of the point-to-point test between each ordered pair of nodes, in MB."""
    slow_factor: float = 1.5
    """A node is flagged slow when its p2p send or receive bandwidth, or its matmul throughput, is this many times below the median of the nodes."""
    matmul_n: int = 1024
    """Matrix size n of the per-device n x n x n matrix-multiply throughput test."""


@dataclass
class PlanConfig:
    """What-if inputs of the memory budget (python -m dtk.plan): plan a model that is not written yet."""

    params: float | None = None
    """Parameter count, e.g. 7.5e9: plan this many parameters instead of the model's. None: the model's own."""
    layers: int | None = None
    """Repeated blocks of the what-if model (FSDP units, pipeline stages, per-layer buffers)."""
    hidden: int | None = None
    """Hidden size of the what-if model (activations, gathered layers)."""
    seq_len: int | None = None
    """Sequence length of the what-if model (activations)."""
    heads: int | None = None
    """Attention heads of the what-if model (attention scores in activations)."""
    vocab_size: int | None = None
    """Vocabulary of the what-if model (embedding, output head and logits)."""
    param_bytes: float | None = None
    """Bytes per parameter held, to follow another framework's accounting (the ZeRO paper: 2); > 0. None: dtk's fp32 (4). python -m dtk.plan only: dtk.submit refuses it (its memory check counts what the workers hold)."""
    grad_bytes: float | None = None
    """Bytes per gradient element (the ZeRO paper: 2); > 0. None: dtk's fp32 (4). python -m dtk.plan only, like param_bytes."""
    optimizer_bytes: float | None = None
    """Optimizer state bytes per parameter (the ZeRO paper: 12, fp32 master copy and two moments); 0 or more. None: AdamW's two fp32 moments (8). python -m dtk.plan only, like param_bytes."""
    max_nodes: int | None = None
    """Most nodes the planner's search may recommend, 1 to 4096. None: up to 4096."""
    count_timeout_s: float = 60.0
    """Seconds the planner (dtk.plan, dtk.submit) gives a `_target_` model to be built on the meta device and counted, in a subprocess; past it, dtk.plan fails and dtk.submit submits without the memory check. Raise it for a model whose construction is slow or a loaded machine."""
    doctor: str | None = None
    """A `python -m dtk.doctor` folder (or its doctor.json): its measured bus bandwidths inside a node and across nodes are the links of the planner's step time. None: cluster.intra_node_gbps / inter_node_gbps, else the accelerator's figures."""
