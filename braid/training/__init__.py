"""Training machinery around the executor: the mixed-precision sharded optimizer, gradient
norms and clipping, learning-rate schedules, real data."""
