"""`python -m experiments.bench.accelerator`: see the package docstring."""
from experiments.bench.accelerator import main

main()
