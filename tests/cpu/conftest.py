"""CPU-test fixtures: host C++ programs built from the kernel headers' host-compilable parts."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def run_host_program(tmp_path):
    """Builds `source` (C++17, the repository root and `include_dirs` on the include path), runs it and
    asserts that it exits 0 and prints "0 failures" last; skips without a host C++ compiler."""
    def run(source, include_dirs=(), timeout=120):
        cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
        if cxx is None:
            pytest.skip("no C++ compiler found to build the host check")
        prog = tmp_path / "check.cpp"
        prog.write_text(source)
        exe = tmp_path / "check"
        incs = [arg for d in include_dirs for arg in ("-I", str(d))]
        res = subprocess.run([cxx, "-std=c++17", "-O1", *incs, "-I", ROOT, str(prog), "-o", str(exe)],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.strip().endswith("0 failures")
    return run
