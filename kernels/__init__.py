"""Attention kernels. Each kernel is a package with `reference.py` (readable, naive),
`xla.py` (fast pure-JAX), `pallas.py` (Pallas kernel written for Triton / GPU) and
`mosaic.py` (Pallas kernel written for Mosaic / TPU), plus one public entry point that
dispatches on `impl=` by the platform the program is lowered for (`dispatch.py`).
`kernels` imports neither `models` nor `rl`."""
