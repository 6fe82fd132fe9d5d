"""An image classifier trained by dtk: a small CNN, a dataset of .npy arrays, a
cross-entropy loss and an accuracy metric. Plain PyTorch and numpy; nothing of dtk is
imported here. conf/ names each piece (docs/byo.md walks through it).

    python images.py data          # writes data/images.npy and data/labels.npy
    python -m dtk.submit           # from this folder: trains on 2 processes (ddp)

The images are 1 x 12 x 12 float32 arrays of 4 classes (a horizontal bar, a vertical bar,
a diagonal, a square) at random places with noise: small enough to train on a CPU in
seconds, hard enough that a model must learn shapes to classify them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SIZE = 12
NUM_CLASSES = 4


# --- data ---------------------------------------------------------------------------------


def make_dataset(folder: str | Path, *, num_samples: int = 1024, seed: int = 0) -> None:
    """Write images.npy (N, 1, SIZE, SIZE) float32 and labels.npy (N,) int64 to `folder`."""
    rng = np.random.default_rng(seed)
    images = rng.normal(0.0, 0.3, size=(num_samples, 1, SIZE, SIZE)).astype(np.float32)
    labels = rng.integers(0, NUM_CLASSES, size=num_samples)
    for image, label in zip(images, labels, strict=True):
        r, c = rng.integers(1, SIZE - 7, size=2)
        if label == 0:
            image[0, r + 3, c : c + 6] += 1.0
        elif label == 1:
            image[0, r : r + 6, c + 3] += 1.0
        elif label == 2:
            image[0, np.arange(r, r + 6), np.arange(c, c + 6)] += 1.0
        else:
            image[0, r : r + 4, c : c + 4] += 0.6
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "images.npy", images)
    np.save(out / "labels.npy", labels.astype(np.int64))


class NpyImages:
    """A map-style dataset over two memory-mapped arrays: item i is (image, label)."""

    def __init__(self, folder: Path) -> None:
        self.images = np.load(folder / "images.npy", mmap_mode="r")
        self.labels = np.load(folder / "labels.npy", mmap_mode="r")

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return np.array(self.images[i]), np.array(self.labels[i])


def load(path: str) -> NpyImages:
    """The data function of conf/data/images.yaml; a relative path is from this folder."""
    folder = Path(path)
    if not folder.is_absolute():
        folder = Path(__file__).resolve().parent / folder
    if not (folder / "images.npy").is_file():
        raise FileNotFoundError(f"no images.npy in {folder}; write it with: python images.py {path}")
    return NpyImages(folder)


# --- model --------------------------------------------------------------------------------


class ConvBlock(nn.Module):
    """A 3x3 convolution and ReLU: the unit FSDP shards (wrap_classes: [ConvBlock]). No batch
    normalisation: its statistics would be per rank, so schemes would not compute the same."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class SmallCNN(nn.Module):
    """Two convolution blocks, a max over the image (where the shape is does not matter),
    a linear head: (batch, 1, SIZE, SIZE) images -> (batch, num_classes) logits."""

    def __init__(self, width: int, num_classes: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(ConvBlock(1, width), ConvBlock(width, width))
        self.head = nn.Linear(width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(images).amax(dim=(2, 3)))


def build(*, width: int, num_classes: int = NUM_CLASSES) -> SmallCNN:
    """The factory of conf/model/cnn.yaml."""
    return SmallCNN(width, num_classes)


# --- loss and metric: (outputs, batch) -> the mean over the micro-batch ---------------------


def cross_entropy(logits: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(logits.float(), batch[1])


def accuracy(logits: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return (logits.argmax(dim=-1) == batch[1]).float().mean()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python images.py DATA_FOLDER")
    make_dataset(sys.argv[1])
    print(f"wrote {sys.argv[1]}/images.npy and labels.npy")
