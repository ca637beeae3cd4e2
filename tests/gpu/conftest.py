"""GPU tests: skipped with a clear reason where there is no CUDA GPU or no compiled library. A library
named through FLASHTILE_LIBRARY_DIR that cannot be loaded stops the run instead: that is a wrong path or
a failed build, not a machine without the library."""
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    reason = None
    if not torch.cuda.is_available():
        reason = "needs a CUDA GPU (torch.cuda.is_available() is False)"
    else:
        import flashtile._lib as lib
        try:
            lib.lib()
        except lib.LibraryNotAvailableError as e:
            if os.environ.get("FLASHTILE_LIBRARY_DIR"):
                raise pytest.UsageError(f"FLASHTILE_LIBRARY_DIR names no loadable library: {e}") from e
            reason = f"compiled flashtile library not available: {e}"
    if reason:
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if "tests/gpu" in str(item.fspath).replace("\\", "/"):
                item.add_marker(skip)
