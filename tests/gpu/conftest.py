"""GPU tests: skipped with a clear reason where there is no CUDA GPU or no compiled library."""
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
            reason = f"compiled flashtile library not available: {e}"
    if reason:
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if "tests/gpu" in str(item.fspath).replace("\\", "/"):
                item.add_marker(skip)
