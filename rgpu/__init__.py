"""rgpu: pool the GPUs of an HPC cluster and serve slices of them to Slurm jobs."""

__version__ = "0.1.0"
