"""Pieces of experiments.bench.accelerator: the budgeted process runner and the parts."""
