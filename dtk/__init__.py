"""dtk: take a PyTorch training job from one machine to many Slurm nodes and keep it running."""

from dtk.common.moved import install

install()  # module paths of earlier releases (a queued job's pickle) resolve to today's modules

__version__ = "0.1.0"
