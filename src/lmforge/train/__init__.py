"""The training loop and what keeps it alive: checkpoints, metrics, evaluation."""
