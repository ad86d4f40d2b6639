"""The network and nothing else."""
