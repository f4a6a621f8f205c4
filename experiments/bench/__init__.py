"""Benchmarks: speed and memory measurements; results go to experiments/results/."""
