"""How parameters move: parameter groups, optimizers, schedules, clipping."""
