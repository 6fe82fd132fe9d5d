"""Accelerators dtk knows by name (`cluster.accelerator`): memory and dense peak throughput.

Memory is what the vendor states, read as decimal GB (1e9 bytes). HBM capacities are
really binary (an "80GB" H100 has 80 GiB = 85.9e9 bytes, of which about 79.6 GiB are
usable), so reading the vendor figure as decimal GB leaves a little room, on purpose.
`cluster.device_memory_gb` overrides the table (a partitioned MIG slice, a new part).

Peaks are dense TFLOP/s (no 2:4 structured sparsity): the data sheets print the sparse
figure for tensor cores, and the dense one is half of it. They are the denominators of
MFU: model FLOPs per second over the peak of the dtype the matmuls run in.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtk.errors import UserError


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


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16/FP16 1,979 and TF32 989 TFLOPS with
        # sparsity, FP32 67 TFLOPS; 80 GB HBM3.
        Accelerator("h100-80gb", 80, 989.5, 989.5, 494.5, 67.0),
        # Same datasheet, H100 PCIe: BF16/FP16 1,513, TF32 756 (sparse), FP32 51; 80 GB HBM2e.
        Accelerator("h100-pcie", 80, 756.5, 756.5, 378.0, 51.0),
        # Same datasheet, H100 NVL: BF16/FP16 1,671, TF32 835 (sparse), FP32 60; 94 GB HBM3.
        Accelerator("h100-nvl", 94, 835.5, 835.5, 417.5, 60.0),
        # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: the H100 SXM's compute
        # (BF16/FP16 1,979, TF32 989 sparse, FP32 67) with 141 GB HBM3e.
        Accelerator("h200", 141, 989.5, 989.5, 494.5, 67.0),
        # Same datasheet, H200 NVL (PCIe card): BF16/FP16 1,671, TF32 835 (sparse), FP32 60; 141 GB.
        Accelerator("h200-nvl", 141, 835.5, 835.5, 417.5, 60.0),
        # NVIDIA A100 Tensor Core GPU datasheet (SXM): BF16/FP16 312, TF32 156 dense, FP32 19.5.
        Accelerator("a100-40gb", 40, 312.0, 312.0, 156.0, 19.5),
        Accelerator("a100-80gb", 80, 312.0, 312.0, 156.0, 19.5),
        # NVIDIA HGX B200 (1,000 W) per GPU: FP16/BF16 4.5 PFLOPS and TF32 2.2 PFLOPS with
        # sparsity, FP32 75 TFLOPS; 180 GB HBM3e.
        Accelerator("b200", 180, 2250.0, 2250.0, 1100.0, 75.0),
        # NVIDIA L40S datasheet: BF16/FP16 733, TF32 366 (sparse), FP32 91.6; 48 GB GDDR6.
        Accelerator("l40s", 48, 362.05, 362.05, 183.0, 91.6),
        # NVIDIA L4 datasheet: BF16/FP16 242, TF32 120 (sparse), FP32 30.3; 24 GB GDDR6.
        Accelerator("l4", 24, 121.0, 121.0, 60.0, 30.3),
        # AMD Instinct MI300X data sheet: FP16/BF16 1,307.4, TF32 653.7 dense, FP32 163.4; 192 GB HBM3.
        Accelerator("mi300x", 192, 1307.4, 1307.4, 653.7, 163.4),
    )
}


def lookup(name: str) -> Accelerator:
    """The table entry for `cluster.accelerator`; a name not in it is a user error."""
    key = name.strip().lower()
    if key not in ACCELERATORS:
        raise UserError(
            f"cluster.accelerator={name}: not a known accelerator; known: {', '.join(ACCELERATORS)}"
            " (or set cluster.device_memory_gb for another device)"
        )
    return ACCELERATORS[key]
