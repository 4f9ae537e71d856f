"""Benchmarks: scripts that measure, never timed unit tests. Results go to bench/results/."""
