"""Helpers the experiment scripts share (benchmarking, plots, seeds); they import the
library only, never a script."""
