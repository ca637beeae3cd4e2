"""Benchmark harness: flashtile against cuDNN, FlashAttention-2 and FlashAttention-3 on the same GPU.

Run it as `python -m flashtile.bench --help`. `report` holds the pure-Python parts (FLOP counts, table, JSON,
plot), `anchors` the timed implementations; neither imports torch or JAX until it is used.
"""


def main(argv=None) -> int:
    """Entry point for a console script; same as `python -m flashtile.bench`."""
    from .__main__ import main as _main
    return _main(argv)
