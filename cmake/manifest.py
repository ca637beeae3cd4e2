#!/usr/bin/env python3
"""The kernel manifest: the single source of truth for which kernel instances are built.

From the build options (archs, dtypes, head dims, features) it enumerates every kernel instance and
generates, into --out:
  kernels/<name>.cu        one explicit instantiation per instance
  dispatch_table.inc       the C++ dispatch tables, forward and backward (common/dispatch.cpp includes it)
  build_config.json        what was built; installed with the package and embedded in the library
  build_config.inc         the same JSON as a C string (ft_build_config())
  sources_<family>.txt     the generated sources of each kernel family, for CMake's per-arch flags

It is also importable (`enumerate_kernels`) so tests can check the manifest against the dispatch
table and the installed build config.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

DTYPES = {"fp16": ("cutlass::half_t", "kFtFloat16"), "bf16": ("cutlass::bfloat16_t", "kFtBFloat16")}
HEAD_DIMS = (64, 96, 128, 192, 256)
HEAD_DIM_PAIRS = {(192, 128)}  # (qk, v) pairs beyond the square buckets
FEATURES = ("softcap",)
PATHS = {"ampere": "kFtPathAmpere", "hopper": "kFtPathHopper"}
# Operations and the kernel families that implement each.
OPS = {"fwd": ("ampere", "hopper"), "bwd": ("ampere", "hopper")}
PARAMS_TYPE = {"fwd": "FwdParams", "bwd": "BwdParams"}

# Kernel sets selectable with FLASHTILE_KERNEL_SET; explicit options override them.
KERNEL_SETS = {
    "full": dict(archs="80;90a", dtypes="bf16;fp16", hdims="64;96;128;192;256", features="softcap"),
    "dev": dict(archs="90a", dtypes="bf16", hdims="128", features="softcap"),
    "ci": dict(archs="80", dtypes="bf16", hdims="128", features=""),
}


def abi_version() -> int:
    """FT_ABI_VERSION from common/flash_api.h (the build config records the ABI it was built with)."""
    header = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common", "flash_api.h")
    with open(header) as f:
        for line in f:
            if line.startswith("#define FT_ABI_VERSION"):
                return int(line.split()[2])
    raise RuntimeError(f"FT_ABI_VERSION not found in {header}")


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.replace(",", ";").split(";") if x.strip()]


def parse_hdims(spec: str) -> list[tuple[int, int]]:
    """'64;128;192x128' -> [(64, 64), (128, 128), (192, 128)]."""
    out = []
    for tok in _split(spec):
        if "x" in tok:
            qk, v = (int(t) for t in tok.split("x"))
            if (qk, v) not in HEAD_DIM_PAIRS:
                raise ValueError(f"head-dim pair {tok} is not one of {sorted(HEAD_DIM_PAIRS)}")
        else:
            qk = v = int(tok)
            if qk not in HEAD_DIMS:
                raise ValueError(f"head dim {qk} is not one of {HEAD_DIMS}")
        out.append((qk, v))
    return out


def path_archs(path: str, archs: list[str]) -> list[str]:
    """SASS targets a kernel family is compiled for, given the requested archs."""
    if path == "ampere":
        # mma.sync code needs no arch-specific features: sm_90a requests plain sm_90 SASS.
        return sorted({a.rstrip("a") for a in archs if int(a.rstrip("a")) >= 80}, key=int)
    if path == "hopper":
        return ["90a"] if "90a" in archs else []
    raise ValueError(path)


def enumerate_kernels(archs: str, dtypes: str, hdims: str, features: str, ops: str = "") -> list[dict]:
    """Every kernel instance of the options; `ops` (e.g. "fwd") limits the operations (empty = all)."""
    arch_list = _split(archs)
    op_list = _split(ops) or list(OPS)
    for op in op_list:
        if op not in OPS:
            raise ValueError(f"unknown operation {op}; known: {sorted(OPS)}")
    for a in arch_list:
        if a not in ("80", "86", "89", "90", "90a"):
            raise ValueError(f"unsupported arch {a}; use 80, 86, 89 or 90a")
    feats = set(_split(features))
    unknown = feats - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}; known: {FEATURES}")
    for dtype in _split(dtypes):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype} is not one of {sorted(DTYPES)}")
    kernels = []
    for op, paths in OPS.items():
        if op not in op_list:
            continue
        for path in paths:
            sass = path_archs(path, arch_list)
            if not sass:
                continue
            for dtype in _split(dtypes):
                for qk, v in parse_hdims(hdims):
                    for mask in ("none", "band"):
                        for softcap in (False, True) if "softcap" in feats else (False,):
                            name = f"{path}_{op}_{dtype}_hd{qk}x{v}_{mask}" + ("_softcap" if softcap else "")
                            kernels.append(dict(name=name, op=op, path=path, dtype=dtype, head_dim=qk,
                                                head_dim_v=v, mask=mask, softcap=softcap,
                                                archs=[f"sm_{a}" for a in sass]))
    return kernels


def _instantiation(k: dict) -> str:
    ctype = DTYPES[k["dtype"]][0]
    band = "true" if k["mask"] == "band" else "false"
    sc = "true" if k["softcap"] else "false"
    op = k["op"]
    return (f"// Generated by cmake/manifest.py: {k['name']}.\n"
            f'#include "{k["path"]}/{op}_launch.h"\n\n'
            f"namespace flashtile {{\n"
            f"LaunchStatus {k['name']}({PARAMS_TYPE[op]} const& params, cudaStream_t stream) {{\n"
            f"  return {k['path']}::run_{op}<{ctype}, {k['head_dim']}, {k['head_dim_v']}, {band}, {sc}>(params, stream);\n"
            f"}}\n"
            f"}}  // namespace flashtile\n")


def _dispatch_table(kernels: list[dict]) -> str:
    lines = ["// Generated by cmake/manifest.py: the dispatch tables, one per operation.", "namespace flashtile {"]
    for op in OPS:
        ptype = PARAMS_TYPE[op]
        entries = [k for k in kernels if k["op"] == op]
        for k in entries:
            lines.append(f"LaunchStatus {k['name']}({ptype} const& params, cudaStream_t stream);")
        lines.append(f"constexpr KernelEntry<{ptype}> k{op.capitalize()}Kernels[] = {{")
        for k in entries:
            lines.append(f"    {{{PATHS[k['path']]}, {DTYPES[k['dtype']][1]}, {k['head_dim']}, {k['head_dim_v']}, "
                         f"{'true' if k['mask'] == 'band' else 'false'}, {'true' if k['softcap'] else 'false'}, "
                         f"&{k['name']}, \"{k['name']}\"}},")
        if not entries:
            lines.append("    {0, 0, 0, 0, false, false, nullptr, \"\"},  // none built: never matches")
        lines.append("};")
    lines += ["}  // namespace flashtile", ""]
    return "\n".join(lines)


def build_config(kernels: list[dict], args) -> dict:
    return dict(abi_version=args.abi_version, version=args.version, kernel_set=args.kernel_set,
                archs=_split(args.archs), dtypes=_split(args.dtypes),
                head_dims=[list(p) for p in parse_hdims(args.hdims)], features=_split(args.features),
                ops=_split(args.ops) or list(OPS),
                cuda_version=args.cuda_version, cutlass_version=args.cutlass_version, kernels=kernels)


def _write_if_changed(path: str, text: str) -> None:
    # Unchanged files keep their timestamps so reconfiguring does not rebuild every kernel.
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return
    with open(path, "w") as f:
        f.write(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernel-set", default="full", choices=sorted(KERNEL_SETS))
    ap.add_argument("--archs", default="")
    ap.add_argument("--dtypes", default="")
    ap.add_argument("--hdims", default="")
    ap.add_argument("--features", default="", help="empty = preset; 'none' = no optional features")
    ap.add_argument("--ops", default="", help="operations to build, e.g. fwd (empty = all)")
    ap.add_argument("--version", default="0.0.0")
    ap.add_argument("--abi-version", type=int, default=abi_version())
    ap.add_argument("--cuda-version", default="")
    ap.add_argument("--cutlass-version", default="")
    args = ap.parse_args(argv)
    preset = KERNEL_SETS[args.kernel_set]
    for key in ("archs", "dtypes", "hdims", "features"):
        if not getattr(args, key):
            setattr(args, key, preset[key])
    if args.features == "none":
        args.features = ""

    kernels = enumerate_kernels(args.archs, args.dtypes, args.hdims, args.features, args.ops)
    os.makedirs(os.path.join(args.out, "kernels"), exist_ok=True)
    families: dict[str, list[str]] = {"ampere": [], "hopper": []}
    for k in kernels:
        path = os.path.join(args.out, "kernels", k["name"] + ".cu")
        _write_if_changed(path, _instantiation(k))
        families[k["path"]].append(path)
    _write_if_changed(os.path.join(args.out, "dispatch_table.inc"), _dispatch_table(kernels))
    cfg = json.dumps(build_config(kernels, args), indent=1, sort_keys=True)
    _write_if_changed(os.path.join(args.out, "build_config.json"), cfg + "\n")
    _write_if_changed(os.path.join(args.out, "build_config.inc"),
                      "// Generated by cmake/manifest.py.\nnamespace flashtile {\n"
                      f"constexpr char kBuildConfigJson[] = R\"ftjson({cfg})ftjson\";\n}}  // namespace flashtile\n")
    for fam, srcs in families.items():
        _write_if_changed(os.path.join(args.out, f"sources_{fam}.txt"), ";".join(srcs))
        sass = path_archs(fam, _split(args.archs))
        _write_if_changed(os.path.join(args.out, f"archs_{fam}.txt"), ";".join(sass))
    return 0


if __name__ == "__main__":
    sys.exit(main())
