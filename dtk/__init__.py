"""dtk: take a PyTorch training job from one machine to many Slurm nodes and keep it running."""

__version__ = "0.1.0"
