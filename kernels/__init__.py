"""Attention kernels. Each kernel is a package with `reference.py` (readable, naive),
`xla.py` (fast pure-JAX) and `pallas.py` (Pallas kernel), plus one public entry point
that dispatches on `impl=`. `kernels` imports neither `models` nor `rl`."""
