"""Test setup: import the installed flashtile, or the source tree's python/ when none is installed."""
import os
import sys

try:
    import flashtile  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
