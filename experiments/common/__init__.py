"""Helpers the experiment scripts share (benchmarking, plots, seeds, trace: a jax profiler
trace summarized as device busy share and host launches, flags: the train
command line as a RunConfig view, train_cli: that command as a function, docs_rows: a results table's row
rewritten in place); they import the
library only, never a script."""
