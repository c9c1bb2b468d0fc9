"""Measuring on the machine: the multi-rank job launcher, the profiler of unit costs, the bench
runs of schedules and baselines, their calibration against the simulator and their report.
The command-line faces are ``braid.profile`` and ``braid.bench``."""
