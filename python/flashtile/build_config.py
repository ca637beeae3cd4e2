"""What this installation was built with, and the check that a requested kernel exists.

Asking for a configuration that was not compiled raises KernelNotBuiltError (a NotImplementedError)
that names the request and lists what was built, before any kernel runs.
"""
from __future__ import annotations

from . import _lib

HEAD_DIM_BUCKETS = (64, 96, 128, 192, 256)


class KernelNotBuiltError(NotImplementedError):
    """The requested kernel configuration is not part of this build."""


_cache: dict = {}  # "config" -> the installed config; request tuples -> matching kernel names


def build_config() -> dict:
    """The installed build configuration (archs, dtypes, head dims, features and the kernel list)."""
    if "config" not in _cache:
        _cache["config"] = _lib.installed_build_config()
    return _cache["config"]


build_config.cache_clear = _cache.clear  # also drops cached kernel lookups


def head_dim_bucket(d: int) -> int:
    for b in HEAD_DIM_BUCKETS:
        if d <= b:
            return b
    return 0


def describe(cfg: dict) -> str:
    """One line listing the kernels of a build config."""
    groups: dict[tuple, set] = {}
    for k in cfg["kernels"]:
        key = (k["op"], k["path"], k["dtype"], f"{k['head_dim']}x{k['head_dim_v']}")
        groups.setdefault(key, set()).add(k["mask"] + ("+softcap" if k["softcap"] else ""))
    if not groups:
        return "no kernels"
    return "; ".join(f"{op} {path} {dt} hdim {hd} [{', '.join(sorted(m))}]"
                     for (op, path, dt, hd), m in sorted(groups.items()))


def find_kernels(*, op: str, dtype: str, head_dim: int, head_dim_v: int, band: bool, softcap: bool,
                 path: str = "auto") -> list[dict]:
    """Kernel entries matching a request (bucketed head dims); the path filter applies unless 'auto'."""
    hd, hdv = head_dim_bucket(head_dim), head_dim_bucket(head_dim_v)
    mask = "band" if band else "none"
    return [k for k in build_config()["kernels"]
            if k["op"] == op and k["dtype"] == dtype and k["head_dim"] == hd and k["head_dim_v"] == hdv
            and k["mask"] == mask and k["softcap"] == softcap and (path == "auto" or k["path"] == path)]


def require_kernel(*, op: str, dtype: str, head_dim: int, head_dim_v: int, band: bool, softcap: bool,
                   path: str = "auto") -> tuple:
    """Names of the matching kernels (cached: this runs on every call), or KernelNotBuiltError."""
    key = (op, dtype, head_dim, head_dim_v, band, softcap, path)
    if key in _cache:
        return _cache[key]
    found = find_kernels(op=op, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, band=band,
                         softcap=softcap, path=path)
    if not found:
        cfg = build_config()
        want = (f"{op} path={path} dtype={dtype} head_dim={head_dim} (bucket {head_dim_bucket(head_dim)}) "
                f"head_dim_v={head_dim_v} mask={'band' if band else 'none'} softcap={softcap}")
        raise KernelNotBuiltError(
            f"flashtile was not built with a kernel for {want}. This build (kernel set "
            f"'{cfg.get('kernel_set')}', archs {cfg.get('archs')}) has: {describe(cfg)}. Rebuild with the "
            "FLASHTILE_DTYPES / FLASHTILE_HDIMS / FLASHTILE_FEATURES / FLASHTILE_ARCHS options (see README).")
    _cache[key] = tuple(k["name"] for k in found)
    return _cache[key]
