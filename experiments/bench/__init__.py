"""Benchmarks: experiments/bench/X.py writes experiments/results/bench_X.json."""
