"""Accelerators dtk knows by name (`cluster.accelerator`): the one table of everything dtk
knows about a part. Every other module reads it from here (the memory budget, the step
time of dtk.plan.cost.steptime, the MFU of dtk.train.flops, the names torch gives a device):
an accelerator's name is written in this module only.

Memory is what the vendor states, read as decimal GB (1e9 bytes). HBM capacities are
really binary (an "80GB" H100 has 80 GiB = 85.9e9 bytes, of which about 79.6 GiB are
usable), so reading the vendor figure as decimal GB leaves a little room, on purpose.
`cluster.device_memory_gb` overrides the table (a partitioned MIG slice, a new part).

Peaks are dense TFLOP/s (no 2:4 structured sparsity): NVIDIA's data sheets print the
sparse figure for tensor cores, and the dense one is half of it (AMD's print the dense
one). They are the denominators of MFU: model FLOPs per second over the peak of the dtype
the matmuls run in.

Links are bus bandwidths as nccl-tests reaches them, GB/s per device one way, about 80% of
the link's rate: `nvlink_gbps` between the devices of a node, `nic_gbps` through one
network card of the part's reference node (a DGX / HGX has one 200 Gb/s HDR (A100) or
400 Gb/s NDR (H100 and later) card per GPU; `cluster.nics_per_node` says how many a
node has). `host_gbps` is host <-> device copies (PCIe).

Efficiency is the share of the dense peak that the matmuls of a large transformer's
training step sustain at large GEMMs; narrower GEMMs run below it, by WIDTH_SHARES (the
rate at a GEMM width over the widest's; dtk.plan.cost.steptime multiplies them, unless the
user's own measurement, `cluster.matmul_rates`, replaces the curve). The width is the
harmonic mean of a block's two matmul dimensions on a rank: the hidden size h and the
tensor-parallel slice f / tp of the feed-forward width (`gemm_width`), so both a small
model and a thin tp slice lower it. The levels are what the published runs of
docs/planning.md reach on A100 (Megatron-LM) and H100 (torchtitan, bf16, 500 W parts);
other parts take their generation's and are not checked against a published run.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtk.common.errors import UserError

MEGATRON_RATES = ((3686, 137.0), (4096, 138.3), (5461, 140.9), (6827, 147.5), (8192, 158.8), (10923, 171.1),
                  (13653, 182.8), (17067, 183.1))
"""(GEMM width, TFLOP/s per A100) of Megatron-LM's GPT runs: Narayanan et al. 2021, Efficient
Large-Scale Language Model Training on GPU Clusters (arXiv 2104.04473), Table 1, the
achieved TFLOP/s per GPU of each row (its eq. 3, full recompute, seq 2048, feed-forward 4h),
at the row's gemm_width(h, 4h, t): 1.7B (h 2304, t 1) 137; 3.6B, 7.5B and 18.4B (h 3072 /
4096 / 6144, t 2 / 4 / 8: all at width 4096) 138, 142, 135, their mean 138.3; then with t = 8
39.1B 138, 76.1B 140, 145.6B 148, 310.1B 155, 529.6B 163, 1008B 163. A pipeline row's figure
is scaled by 1 + (p - 1) / m, the bubble the paper's own formula gives its p stages and m
micro-batches per pipeline (batch / data-parallel size: 48, 56, 96, 144, 280, 512), since
dtk's step time adds the bubble itself."""
WIDTH_SHARES = tuple((w, round(r / MEGATRON_RATES[-1][1], 3)) for w, r in MEGATRON_RATES)
"""The matmul rate at a GEMM width over the widest's (MEGATRON_RATES): 0.75 at width 3686
to 1.0 from 13653 on, held beyond both ends."""


def gemm_width(hidden: int, ffn_hidden: int, tp: int) -> float:
    """A block's matmul width on a rank: the harmonic mean of the hidden size (the dimension
    tensor parallelism leaves whole) and the feed-forward width's tp slice."""
    return 2 / (1 / hidden + tp / ffn_hidden)


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gb: float
    """Device memory as the vendor states it, in decimal GB."""
    bf16_tflops: float
    """Dense bf16 tensor-core peak."""
    fp16_tflops: float
    tf32_tflops: float
    """Dense tf32 tensor-core peak (fp32 matmuls with torch.backends.cuda.matmul.allow_tf32)."""
    fp32_tflops: float
    """Non-tensor-core fp32 peak."""
    device_names: tuple[str, ...]
    """What `torch.cuda.get_device_name` contains for this part (matched as words, the
    longest pattern of the whole table first, so `GH200` is not read as `H200`)."""
    efficiency: float
    """Share of the dense peak a large transformer's matmuls sustain in a training step, at
    the widest GEMMs of WIDTH_SHARES (narrower ones: that share of it)."""
    nvlink_gbps: float
    """Bus bandwidth per device inside a node (NVLink / NVSwitch / Infinity Fabric / PCIe)."""
    nic_gbps: float
    """Bus bandwidth through one network card of the reference node."""
    host_gbps: float
    """Host <-> device copies per device."""
    source: str
    """Where the figures come from."""

    def peak_tflops(self, dtype: str) -> float:
        """Dense peak for `bfloat16`, `float16`, `tf32` or `float32`."""
        table = {
            "bfloat16": self.bf16_tflops,
            "float16": self.fp16_tflops,
            "tf32": self.tf32_tflops,
            "float32": self.fp32_tflops,
        }
        if dtype not in table:
            raise ValueError(f"no peak for dtype {dtype!r}; known: {', '.join(table)}")
        return table[dtype]


_H100 = "NVIDIA H100 Tensor Core GPU datasheet"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet"
ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator("a100-40gb", 40, 312.0, 312.0, 156.0, 19.5, ("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB"),
                    0.61, 230.0, 22.0, 25.0,
                    f"{_A100} (SXM): BF16/FP16 312, TF32 156 dense, FP32 19.5; 40 GB HBM2; NVLink 3 600 GB/s"
                    " (300 each way); DGX A100: one 200 Gb/s HDR card per GPU"),
        Accelerator("a100-80gb", 80, 312.0, 312.0, 156.0, 19.5, ("A100",), 0.61, 230.0, 22.0, 25.0,
                    f"{_A100} (SXM): as the 40 GB part, 80 GB HBM2e"),
        Accelerator("a800", 80, 312.0, 312.0, 156.0, 19.5, ("A800",), 0.61, 155.0, 22.0, 25.0,
                    "NVIDIA A800 SXM4 80GB: the A100's compute and memory with NVLink at 400 GB/s (200 each way)"),
        Accelerator("h100-80gb", 80, 989.5, 989.5, 494.5, 67.0, ("H100 80GB HBM3", "H100 SXM", "H100"),
                    0.40, 360.0, 45.0, 50.0,
                    f"{_H100} (SXM5): BF16/FP16 1,979 and TF32 989 with sparsity, FP32 67; 80 GB HBM3;"
                    " NVLink 4 900 GB/s (450 each way); DGX H100: one 400 Gb/s NDR card per GPU"),
        Accelerator("h100-pcie", 80, 756.5, 756.5, 378.0, 51.0, ("H100 PCIe",), 0.40, 240.0, 22.0, 50.0,
                    f"{_H100}, H100 PCIe: BF16/FP16 1,513, TF32 756 (sparse), FP32 51; 80 GB HBM2e"),
        Accelerator("h100-nvl", 94, 835.5, 835.5, 417.5, 60.0, ("H100 NVL",), 0.40, 240.0, 45.0, 50.0,
                    f"{_H100}, H100 NVL: BF16/FP16 1,671, TF32 835 (sparse), FP32 60; 94 GB HBM3"),
        Accelerator("h800", 80, 989.5, 989.5, 494.5, 67.0, ("H800",), 0.40, 160.0, 45.0, 50.0,
                    "NVIDIA H800 SXM5: the H100 SXM's BF16/FP16/TF32 compute and 80 GB with NVLink at"
                    " 400 GB/s (200 each way)"),
        Accelerator("h200", 141, 989.5, 989.5, 494.5, 67.0, ("H200",), 0.40, 360.0, 45.0, 50.0,
                    f"{_H200}, H200 SXM: the H100 SXM's compute (BF16/FP16 1,979, TF32 989 sparse, FP32 67)"
                    " with 141 GB HBM3e"),
        Accelerator("h200-nvl", 141, 835.5, 835.5, 417.5, 60.0, ("H200 NVL",), 0.40, 360.0, 45.0, 50.0,
                    f"{_H200}, H200 NVL (PCIe card): BF16/FP16 1,671, TF32 835 (sparse), FP32 60; 141 GB"),
        Accelerator("gh200", 96, 989.5, 989.5, 494.5, 67.0, ("GH200",), 0.40, 360.0, 45.0, 450.0,
                    "NVIDIA GH200 Grace Hopper Superchip datasheet: the H100 SXM's compute (BF16/FP16 1,979,"
                    " TF32 989 sparse, FP32 67), 96 GB HBM3 (the 144 GB HBM3e part: cluster.device_memory_gb=144),"
                    " NVLink-C2C to the Grace CPU 900 GB/s (450 each way)"),
        Accelerator("b200", 180, 2250.0, 2250.0, 1100.0, 75.0, ("B200",), 0.40, 720.0, 45.0, 50.0,
                    "NVIDIA HGX B200 (1,000 W) per GPU: FP16/BF16 4.5 PFLOPS and TF32 2.2 PFLOPS with sparsity,"
                    " FP32 75 TFLOPS; 180 GB HBM3e; NVLink 5 1.8 TB/s (900 each way)"),
        Accelerator("l40s", 48, 362.05, 362.05, 183.0, 91.6, ("L40S",), 0.45, 20.0, 10.0, 25.0,
                    "NVIDIA L40S datasheet: BF16/FP16 733, TF32 366 (sparse), FP32 91.6; 48 GB GDDR6; PCIe peers"),
        Accelerator("l4", 24, 121.0, 121.0, 60.0, 30.3, ("L4",), 0.45, 20.0, 10.0, 25.0,
                    "NVIDIA L4 datasheet: BF16/FP16 242, TF32 120 (sparse), FP32 30.3; 24 GB GDDR6; PCIe peers"),
        Accelerator("mi250x", 64, 191.5, 191.5, 47.9, 23.95, ("MI250X",), 0.35, 40.0, 22.0, 25.0,
                    "AMD Instinct MI250X data sheet: FP16/BF16 383 dense, FP32 matrix 95.7, FP32 vector 47.9,"
                    " 128 GB HBM2e, for the module's two GCDs; torch sees each GCD as a device, so the row is"
                    " one GCD (half of each; no TF32: its column is the FP32 matrix rate). Infinity Fabric"
                    " 50 GB/s links between the packages of a node"),
        Accelerator("mi300x", 192, 1307.4, 1307.4, 653.7, 163.4, ("MI300X",), 0.35, 300.0, 45.0, 50.0,
                    "AMD Instinct MI300X data sheet: FP16/BF16 1,307.4, TF32 653.7 dense, FP32 163.4; 192 GB HBM3"),
    )
}
GENERIC = Accelerator("generic", 0.0, 0.0, 0.0, 0.0, 0.0, (), 0.40, 200.0, 20.0, 25.0,
                      "a GPU dtk does not know by name (cluster.peak_tflops given): a middling part")


def lookup(name: str) -> Accelerator:
    """The table entry for `cluster.accelerator`; a name not in it is a user error."""
    key = name.strip().lower()
    if key not in ACCELERATORS:
        raise UserError(
            f"cluster.accelerator={name}: not a known accelerator; known: {', '.join(ACCELERATORS)}"
            " (or set cluster.device_memory_gb for another device)"
        )
    return ACCELERATORS[key]


def _words(text: str) -> list[str]:
    return text.upper().replace("-", " ").replace("/", " ").split()


def accelerator_of(device_name: str) -> str | None:
    """The table's name for a device name (`NVIDIA H100 80GB HBM3` -> h100-80gb): the row of
    the longest pattern whose words appear in the name, one after the other."""
    words = _words(device_name)
    patterns = sorted(((p, a.name) for a in ACCELERATORS.values() for p in a.device_names),
                      key=lambda row: -len(row[0]))
    for pattern, name in patterns:
        want = _words(pattern)
        if any(words[i:i + len(want)] == want for i in range(len(words) - len(want) + 1)):
            return name
    return None
