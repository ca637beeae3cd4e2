"""CPU-test fixtures: host C++ programs built from the kernel headers' host-compilable parts."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cutlass_include():
    try:
        import cutlass_library
    except ImportError:
        return None
    inc = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    return inc if os.path.exists(os.path.join(inc, "cute", "tensor.hpp")) else None


@pytest.fixture
def run_host_program(tmp_path):
    """Builds `source` (C++17, the repository root and `include_dirs` on the include path), runs it and
    asserts that it exits 0 and prints "0 failures" last; skips without a host C++ compiler.
    cute=True: the program includes CuTe / CUTLASS headers, which need nvcc (host code only: nothing
    runs on a GPU) and the nvidia-cutlass package's headers; skips without them."""
    def run(source, include_dirs=(), timeout=120, cute=False):
        incs = [arg for d in include_dirs for arg in ("-I", str(d))]
        if cute:
            nvcc = shutil.which("nvcc")
            cutlass = _cutlass_include()
            if nvcc is None or cutlass is None:
                pytest.skip("nvcc and the nvidia-cutlass headers are needed to build this host check")
            prog = tmp_path / "check.cu"
            cmd = [nvcc, "-std=c++17", "-O1", "--expt-relaxed-constexpr", *incs, "-I", cutlass, "-I", ROOT]
        else:
            cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
            if cxx is None:
                pytest.skip("no C++ compiler found to build the host check")
            prog = tmp_path / "check.cpp"
            cmd = [cxx, "-std=c++17", "-O1", *incs, "-I", ROOT]
        prog.write_text(source)
        exe = tmp_path / "check"
        res = subprocess.run([*cmd, str(prog), "-o", str(exe)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.strip().endswith("0 failures")
    return run
