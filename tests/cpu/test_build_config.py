"""Agreement between the kernel manifest, the generated dispatch table, the build config, the C ABI
header and the Python side, plus the KernelNotBuiltError logic.

cmake/manifest.py is run for every kernel-set preset into temporary folders and its outputs are
checked against each other. The installed library (when present) must embed the installed
build_config.json, and both must equal what the manifest enumerates for the recorded options. The
require_kernel tests use a substituted build config, so they run without any library.
"""
import ctypes
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import flashtile
from flashtile import _lib, _validate

BC = sys.modules["flashtile.build_config"]  # the module (flashtile.build_config is the function)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MANIFEST_PATH = os.path.join(ROOT, "cmake", "manifest.py")
FLASH_API_H = os.path.join(ROOT, "common", "flash_api.h")
TILE_POLICY_H = os.path.join(ROOT, "common", "tile_policy.h")


def _load_manifest():
    spec = importlib.util.spec_from_file_location("flashtile_manifest", MANIFEST_PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


manifest = _load_manifest()


def _header(path):
    with open(path) as f:
        return re.sub(r"//[^\n]*", "", f.read())


def _c_enum_values(text):
    return {name: int(val) for name, val in re.findall(r"\b(kFt\w+)\s*=\s*(\d+)", text)}


@pytest.fixture
def fresh_config():
    BC.build_config.cache_clear()
    yield
    BC.build_config.cache_clear()


# ---- manifest outputs --------------------------------------------------------------------------------

ENTRY_RE = re.compile(r"\{(kFtPath\w+), (kFt\w+), (\d+), (\d+), (true|false), (true|false), &(\w+), \"(\w+)\"\},")


def _generate(tmp_path, *argv):
    out = tmp_path / "gen"
    assert manifest.main(["--out", str(out), *argv]) == 0
    with open(out / "build_config.json") as f:
        cfg = json.load(f)
    return out, cfg


PARAMS_TYPE = {"fwd": "FwdParams", "bwd": "BwdParams"}  # the device-side params struct of each op


def _dispatch_entries(out):
    """The generated tables' text and their entries, in table order (forward, then backward)."""
    text = (out / "dispatch_table.inc").read_text()
    return text, ENTRY_RE.findall(text)


def _table(text, op):
    """The body of one operation's table."""
    m = re.search(r"constexpr KernelEntry<%s> k%sKernels\[\] = \{\n(.*?)\n\};" % (PARAMS_TYPE[op], op.capitalize()),
                  text, re.S)
    assert m is not None, f"no {op} dispatch table"
    return m.group(1)


def _check_outputs(out, cfg):
    """The dispatch table, instantiations, embedded JSON and source lists all describe cfg['kernels']."""
    enums = _c_enum_values(_header(FLASH_API_H))
    names = [k["name"] for k in cfg["kernels"]]
    assert len(set(names)) == len(names)

    assert set(manifest.OPS) == set(PARAMS_TYPE) and manifest.PARAMS_TYPE == PARAMS_TYPE
    assert {k["op"] for k in cfg["kernels"]} <= set(manifest.OPS)
    assert all(k["path"] in manifest.OPS[k["op"]] for k in cfg["kernels"])
    text, _ = _dispatch_entries(out)
    for op in manifest.OPS:
        op_kernels = [k for k in cfg["kernels"] if k["op"] == op]
        body = _table(text, op)
        entries = ENTRY_RE.findall(body)
        assert [e[6] for e in entries] == [k["name"] for k in op_kernels]
        for k, (path_enum, dtype_enum, hd, hdv, band, softcap, fn, name) in zip(op_kernels, entries):
            assert fn == name == k["name"]
            assert path_enum == manifest.PATHS[k["path"]] and path_enum in enums
            assert dtype_enum == manifest.DTYPES[k["dtype"]][1] and dtype_enum in enums
            assert (int(hd), int(hdv)) == (k["head_dim"], k["head_dim_v"])
            assert band == ("true" if k["mask"] == "band" else "false")
            assert softcap == ("true" if k["softcap"] else "false")
            assert f"LaunchStatus {name}({PARAMS_TYPE[op]} const& params, cudaStream_t stream);" in text
        if not op_kernels:
            assert "nullptr" in body  # an empty table still compiles and never matches

    cu_files = sorted(os.listdir(out / "kernels"))
    assert cu_files == sorted(n + ".cu" for n in names)
    for k in cfg["kernels"]:
        src = (out / "kernels" / (k["name"] + ".cu")).read_text()
        ctype = manifest.DTYPES[k["dtype"]][0]
        band = "true" if k["mask"] == "band" else "false"
        sc = "true" if k["softcap"] else "false"
        op = k["op"]
        assert k["name"].startswith(f"{k['path']}_{op}_")
        assert f'#include "{k["path"]}/{op}_launch.h"' in src
        assert f"LaunchStatus {k['name']}({PARAMS_TYPE[op]} const& params, cudaStream_t stream)" in src
        assert f"{k['path']}::run_{op}<{ctype}, {k['head_dim']}, {k['head_dim_v']}, {band}, {sc}>(params, stream)" in src
        assert len(re.findall(r"run_\w+<", src)) == 1

    inc = (out / "build_config.inc").read_text()
    m = re.search(r'kBuildConfigJson\[\] = R"ftjson\((.*)\)ftjson";', inc, re.S)
    assert m is not None
    assert json.loads(m.group(1)) == cfg

    for fam in manifest.PATHS:
        srcs = [s for s in (out / f"sources_{fam}.txt").read_text().split(";") if s]
        assert srcs == [str(out / "kernels" / (k["name"] + ".cu")) for k in cfg["kernels"] if k["path"] == fam]
        archs = [a for a in (out / f"archs_{fam}.txt").read_text().split(";") if a]
        assert archs == manifest.path_archs(fam, cfg["archs"])


@pytest.mark.parametrize("kernel_set", sorted(manifest.KERNEL_SETS))
def test_manifest_presets(tmp_path, kernel_set):
    out, cfg = _generate(tmp_path, "--kernel-set", kernel_set, "--version", "9.8.7", "--cuda-version", "13.0")
    preset = manifest.KERNEL_SETS[kernel_set]
    assert cfg["kernel_set"] == kernel_set and cfg["version"] == "9.8.7" and cfg["cuda_version"] == "13.0"
    assert cfg["abi_version"] == _lib.ABI_VERSION
    assert cfg["archs"] == manifest._split(preset["archs"])
    assert cfg["dtypes"] == manifest._split(preset["dtypes"])
    assert cfg["head_dims"] == [list(p) for p in manifest.parse_hdims(preset["hdims"])]
    assert cfg["features"] == manifest._split(preset["features"])
    assert cfg["ops"] == list(manifest.OPS)
    assert cfg["kernels"] == manifest.enumerate_kernels(preset["archs"], preset["dtypes"], preset["hdims"],
                                                        preset["features"])
    assert cfg["kernels"], "every preset builds at least one kernel"
    _check_outputs(out, cfg)
    # Every (dtype, head dims, mask, softcap) combination of the options is present exactly once per
    # operation and path.
    combos = {(k["op"], k["path"], k["dtype"], k["head_dim"], k["head_dim_v"], k["mask"], k["softcap"])
              for k in cfg["kernels"]}
    assert len(combos) == len(cfg["kernels"])
    n_softcap = 2 if "softcap" in cfg["features"] else 1
    n_op_paths = sum(1 for op, paths in manifest.OPS.items() for path in paths
                     if manifest.path_archs(path, cfg["archs"]))
    assert len(cfg["kernels"]) == n_op_paths * len(cfg["dtypes"]) * len(cfg["head_dims"]) * 2 * n_softcap
    # Every forward configuration has a backward kernel (on some path) in every preset.
    fwd = {(k["dtype"], k["head_dim"], k["head_dim_v"], k["mask"], k["softcap"]) for k in cfg["kernels"] if k["op"] == "fwd"}
    bwd = {(k["dtype"], k["head_dim"], k["head_dim_v"], k["mask"], k["softcap"]) for k in cfg["kernels"] if k["op"] == "bwd"}
    assert fwd == bwd


def test_manifest_full_preset_contents(tmp_path):
    _, cfg = _generate(tmp_path, "--kernel-set", "full")
    assert set(cfg["dtypes"]) == {"bf16", "fp16"}
    assert {tuple(h) for h in cfg["head_dims"]} == {(64, 64), (96, 96), (128, 128), (192, 192), (256, 256)}
    assert {k["softcap"] for k in cfg["kernels"]} == {False, True}
    assert {k["mask"] for k in cfg["kernels"]} == {"none", "band"}
    ampere = [k for k in cfg["kernels"] if k["path"] == "ampere"]
    assert ampere and all(k["archs"] == ["sm_80", "sm_90"] for k in ampere)
    assert {k["op"] for k in cfg["kernels"]} == {"fwd", "bwd"}
    # Both operations have both kernel families, each for every configuration.
    for op in ("fwd", "bwd"):
        assert {k["path"] for k in cfg["kernels"] if k["op"] == op} == {"ampere", "hopper"}
        configs = {}
        for k in cfg["kernels"]:
            if k["op"] == op:
                configs.setdefault(k["path"], set()).add((k["dtype"], k["head_dim"], k["head_dim_v"], k["mask"], k["softcap"]))
        assert configs["ampere"] == configs["hopper"]
    for k in cfg["kernels"]:
        assert k["archs"] == [f"sm_{a}" for a in manifest.path_archs(k["path"], cfg["archs"])]


def test_manifest_explicit_options_override_preset(tmp_path):
    out, cfg = _generate(tmp_path, "--kernel-set", "ci", "--archs", "80;90a", "--dtypes", "fp16",
                         "--hdims", "64;192x128", "--features", "softcap")
    assert cfg["kernel_set"] == "ci"
    assert cfg["archs"] == ["80", "90a"] and cfg["dtypes"] == ["fp16"] and cfg["features"] == ["softcap"]
    assert cfg["head_dims"] == [[64, 64], [192, 128]]
    assert {(k["dtype"], k["head_dim"], k["head_dim_v"]) for k in cfg["kernels"]} == {("fp16", 64, 64), ("fp16", 192, 128)}
    assert "ampere_fwd_fp16_hd192x128_band_softcap" in [k["name"] for k in cfg["kernels"]]
    _check_outputs(out, cfg)


def test_manifest_features_none_disables_preset_features(tmp_path):
    out, cfg = _generate(tmp_path, "--kernel-set", "full", "--features", "none", "--dtypes", "bf16", "--hdims", "128")
    assert cfg["features"] == []
    paths = sorted({k["path"] for k in cfg["kernels"]})
    assert "ampere" in paths
    assert sorted(k["name"] for k in cfg["kernels"]) == sorted(
        f"{p}_{op}_bf16_hd128x128_{m}" for op, op_paths in manifest.OPS.items() for p in op_paths
        if p in paths for m in ("none", "band"))
    _check_outputs(out, cfg)


def test_manifest_regenerates_when_options_shrink(tmp_path):
    out, big = _generate(tmp_path, "--kernel-set", "full")
    _, small = _generate(tmp_path, "--kernel-set", "ci")
    _, entries = _dispatch_entries(out)
    assert [e[6] for e in entries] == [k["name"] for k in small["kernels"]]
    with open(out / "build_config.json") as f:
        assert json.load(f) == small
    srcs = [s for s in (out / "sources_ampere.txt").read_text().split(";") if s]
    assert len(srcs) == len(small["kernels"]) < len(big["kernels"])


def test_manifest_archs_per_path():
    assert manifest.path_archs("ampere", ["80", "90a"]) == ["80", "90"]
    assert manifest.path_archs("ampere", ["90a"]) == ["90"]
    assert manifest.path_archs("ampere", ["86", "80", "89"]) == ["80", "86", "89"]
    assert manifest.path_archs("hopper", ["80", "90a"]) == ["90a"]
    assert manifest.path_archs("hopper", ["80"]) == []
    ks = manifest.enumerate_kernels("90a", "bf16", "128", "")
    assert ks and all(k["archs"] == ["sm_90"] for k in ks if k["path"] == "ampere")


@pytest.mark.parametrize("archs, dtypes, hdims, features, match", [
    ("70", "bf16", "128", "", r"unsupported arch 70"),
    ("80;100a", "bf16", "128", "", r"unsupported arch 100a"),
    ("80", "fp32", "128", "", r"dtype fp32 is not one of"),
    ("80", "e4m3", "128", "", r"dtype e4m3 is not one of"),
    ("80", "bf16", "100", "", r"head dim 100 is not one of"),
    ("80", "bf16", "512", "", r"head dim 512 is not one of"),
    ("80", "bf16", "128x64", "", r"head-dim pair 128x64 is not one of"),
    ("80", "bf16", "192x96", "", r"head-dim pair 192x96"),
    ("80", "bf16", "128", "paged", r"unknown features \['paged'\]"),
    ("80", "bf16", "128", "softcap;split", r"unknown features \['split'\]"),
])
def test_manifest_rejects_invalid_options(archs, dtypes, hdims, features, match):
    with pytest.raises(ValueError, match=match):
        manifest.enumerate_kernels(archs, dtypes, hdims, features)


def test_manifest_ops_filter():
    ks = manifest.enumerate_kernels("80;90a", "bf16", "128", "", "fwd")
    assert ks and {k["op"] for k in ks} == {"fwd"} and {k["path"] for k in ks} == {"ampere", "hopper"}
    assert manifest.enumerate_kernels("80;90a", "bf16", "128", "", "fwd;bwd") == \
        manifest.enumerate_kernels("80;90a", "bf16", "128", "")
    with pytest.raises(ValueError, match=r"unknown operation combine"):
        manifest.enumerate_kernels("80", "bf16", "128", "", "combine")


def test_manifest_main_rejects_invalid_options(tmp_path):
    with pytest.raises(ValueError, match=r"head dim 100"):
        manifest.main(["--out", str(tmp_path / "x"), "--hdims", "100"])
    with pytest.raises(SystemExit):
        manifest.main(["--out", str(tmp_path / "y"), "--kernel-set", "huge"])


def test_manifest_hdim_parsing():
    assert manifest.parse_hdims("64;128,192x128") == [(64, 64), (128, 128), (192, 128)]
    assert manifest.parse_hdims(" 256 ; ") == [(256, 256)]
    ks = manifest.enumerate_kernels("80", "bf16", "192x128", "")
    assert {(k["head_dim"], k["head_dim_v"]) for k in ks} == {(192, 128)}
    assert [k["name"] for k in ks] == ["ampere_fwd_bf16_hd192x128_none", "ampere_fwd_bf16_hd192x128_band",
                                       "ampere_bwd_bf16_hd192x128_none", "ampere_bwd_bf16_hd192x128_band"]


# ---- manifest <-> C ABI header <-> Python ------------------------------------------------------------

def test_constants_agree_across_manifest_header_and_python():
    enums = _c_enum_values(_header(FLASH_API_H))
    assert int(re.search(r"#define FT_ABI_VERSION (\d+)", _header(FLASH_API_H)).group(1)) == _lib.ABI_VERSION
    assert (enums["kFtOk"], enums["kFtInvalidArgument"], enums["kFtNotBuilt"], enums["kFtUnsupportedDevice"],
            enums["kFtCudaError"]) == (_lib.OK, _lib.INVALID_ARGUMENT, _lib.NOT_BUILT, _lib.UNSUPPORTED_DEVICE,
                                       _lib.CUDA_ERROR)
    assert (enums["kFtFloat16"], enums["kFtBFloat16"], enums["kFtFloat8E4M3"]) == (
        _lib.DTYPE_FP16, _lib.DTYPE_BF16, _lib.DTYPE_E4M3)
    assert {"auto": enums["kFtPathAuto"], "ampere": enums["kFtPathAmpere"], "hopper": enums["kFtPathHopper"]} == _lib.PATHS
    for name, (_, enum) in manifest.DTYPES.items():
        assert enums[enum] == {"fp16": _lib.DTYPE_FP16, "bf16": _lib.DTYPE_BF16}[name]
    for name, enum in manifest.PATHS.items():
        assert enums[enum] == _lib.PATHS[name]
    assert set(manifest.DTYPES) == set(_validate.SUPPORTED_DTYPES.values())
    assert manifest.HEAD_DIM_PAIRS == _validate.HEAD_DIM_PAIRS
    assert tuple(manifest.HEAD_DIMS) == BC.HEAD_DIM_BUCKETS
    buckets = re.search(r"kHeadDimBuckets\[\] = \{([^}]*)\}", _header(TILE_POLICY_H)).group(1)
    assert tuple(int(x) for x in buckets.split(",")) == BC.HEAD_DIM_BUCKETS
    for d in range(8, 257, 8):
        assert BC.head_dim_bucket(d) == _validate._bucket(d)
    assert BC.head_dim_bucket(264) == _validate._bucket(264) == 0


def _c_struct_fields(text, struct):
    body = re.search(r"typedef struct %s \{(.*?)\} %s;" % (struct, struct), text, re.S).group(1)
    fields = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        m = re.match(r"(?:const )?(\w+)\s*(\*?)\s*(.*)$", decl)
        ctype, ptr, names = m.groups()
        kind = "ptr" if ptr else ctype
        for name in names.split(","):
            fields.append((name.strip(), kind))
    return fields


CTYPE_KIND = {ctypes.c_void_p: "ptr", ctypes.c_int64: "int64_t", ctypes.c_int32: "int32_t", ctypes.c_float: "float",
              _lib.FtFwdParams: "FtFwdParams"}
STRUCTS = {"FtFwdParams": _lib.FtFwdParams, "FtBwdParams": _lib.FtBwdParams}


@pytest.mark.parametrize("struct", list(STRUCTS))
def test_ctypes_struct_mirrors_c_header(struct):
    c_fields = _c_struct_fields(_header(FLASH_API_H), struct)
    py_fields = [(name, CTYPE_KIND[t]) for name, t in STRUCTS[struct]._fields_]
    assert py_fields == c_fields


def test_bwd_struct_embeds_fwd_struct():
    bwd = _lib.FtBwdParams
    assert bwd.fwd.offset == 0 and bwd.fwd.size == ctypes.sizeof(_lib.FtFwdParams)
    # The pointers follow the embedded struct directly, the two int32 flags close it, and the size is a
    # multiple of the 8-byte alignment (no tail padding hidden from the field list).
    assert ctypes.alignment(bwd) == 8 and ctypes.sizeof(bwd) % 8 == 0
    assert bwd.dout.offset == ctypes.sizeof(_lib.FtFwdParams)
    assert bwd.deterministic.offset + 8 == ctypes.sizeof(bwd) == bwd.reserved.offset + 4
    # Writing through .fwd writes into the enclosing struct (the ops fill it that way).
    p = bwd()
    p.fwd.head_dim, p.fwd.q = 136, 0x1000
    copy = bwd.from_buffer_copy(p)
    assert (copy.fwd.head_dim, copy.fwd.q) == (136, 0x1000)


def test_header_workspace_constants():
    m = re.search(r"#define FT_BWD_SEMAPHORE_ROWS (\d+)", _header(FLASH_API_H))
    assert m is not None and int(m.group(1)) == _lib.BWD_SEMAPHORE_ROWS
    m = re.search(r"#define FT_BWD_ACCUM_ROW_PAD (\d+)", _header(FLASH_API_H))
    assert m is not None and int(m.group(1)) == _lib.BWD_ACCUM_ROW_PAD
    m = re.search(r"#define FT_FWD_COUNTERS (\d+)", _header(FLASH_API_H))
    assert m is not None and int(m.group(1)) == _lib.FWD_COUNTERS


def test_ctypes_struct_layout_matches_c_compiler(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler found to compute the C layout of FtFwdParams/FtBwdParams")
    lines = []
    for struct, cls in STRUCTS.items():
        lines.append(f'  printf("{struct}.size %zu\\n", sizeof({struct}));\n')
        lines += [f'  printf("{struct}.{n} %zu\\n", offsetof({struct}, {n}));\n' for n, _ in cls._fields_]
    prog = tmp_path / "layout.c"
    prog.write_text(
        '#include <stddef.h>\n#include <stdio.h>\n#include "common/flash_api.h"\n'
        "int main(void) {\n" + "".join(lines) + "  return 0;\n}\n")
    exe = tmp_path / "layout"
    res = subprocess.run([cc, "-std=c99", "-I", ROOT, str(prog), "-o", str(exe)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    out = dict(line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                       check=True).stdout.splitlines())
    for struct, cls in STRUCTS.items():
        assert int(out[f"{struct}.size"]) == ctypes.sizeof(cls), struct
        for n, _ in cls._fields_:
            assert int(out[f"{struct}.{n}"]) == getattr(cls, n).offset, f"{struct}.{n}"


# ---- the loader's checks, against a stand-in shared library ------------------------------------------

class _Symbol:
    def __init__(self, value):
        self.value, self.restype, self.argtypes = value, None, None

    def __call__(self, *args):
        return self.value


class _StandInCDLL:
    """What ctypes.CDLL returns, with chosen answers; a symbol left out is missing (AttributeError)."""

    def __init__(self, **symbols):
        for name, value in symbols.items():
            setattr(self, name, _Symbol(value))


def _stand_in(**over):
    cfg = {"kernels": []}
    symbols = dict(ft_abi_version=_lib.ABI_VERSION, ft_fwd_params_size=ctypes.sizeof(_lib.FtFwdParams),
                   ft_bwd_params_size=ctypes.sizeof(_lib.FtBwdParams), ft_build_config=json.dumps(cfg).encode(),
                   ft_last_error=b"", ft_fwd_split_accum_bytes=0, ft_mha_fwd=0, ft_mha_bwd=0)
    symbols.update(over)
    return _StandInCDLL(**{k: v for k, v in symbols.items() if v is not None}), cfg


@pytest.fixture
def fake_library_dir(tmp_path, monkeypatch, fresh_config):
    (tmp_path / "libflashtile.so").write_bytes(b"")
    monkeypatch.setenv("FLASHTILE_LIBRARY_DIR", str(tmp_path))
    monkeypatch.setattr(_lib, "_lib", None)

    def use(lib, cfg):
        (tmp_path / "build_config.json").write_text(json.dumps(cfg))
        monkeypatch.setattr(_lib.ctypes, "CDLL", lambda path: lib)
        return lib
    return use


def test_loader_configures_both_entry_points(fake_library_dir):
    lib = fake_library_dir(*_stand_in())
    assert _lib.lib() is lib
    assert lib.ft_mha_bwd.argtypes == [ctypes.POINTER(_lib.FtBwdParams), ctypes.c_void_p]
    assert lib.ft_mha_fwd.argtypes == [ctypes.POINTER(_lib.FtFwdParams), ctypes.c_void_p]
    assert lib.ft_mha_bwd.restype is ctypes.c_int and lib.ft_bwd_params_size.restype is ctypes.c_int
    # The tail split's scratch size: int64 bytes from (device ordinal, head_dim_v).
    assert lib.ft_fwd_split_accum_bytes.restype is ctypes.c_int64
    assert lib.ft_fwd_split_accum_bytes.argtypes == [ctypes.c_int, ctypes.c_int, ctypes.c_int]


def test_loader_rejects_older_abi_before_looking_up_new_symbols(fake_library_dir):
    # A version-2 library has no backward symbols: the error must be the ABI one, not an AttributeError.
    fake_library_dir(*_stand_in(ft_abi_version=2, ft_bwd_params_size=None, ft_mha_bwd=None))
    with pytest.raises(flashtile.LibraryNotAvailableError, match=rf"ABI version 2, this Python package expects {_lib.ABI_VERSION}"):
        _lib.lib()
    assert _lib._lib is None


@pytest.mark.parametrize("which", ["ft_fwd_params_size", "ft_bwd_params_size"])
def test_loader_rejects_struct_size_mismatch(fake_library_dir, which):
    struct = "FtFwdParams" if which == "ft_fwd_params_size" else "FtBwdParams"
    size = ctypes.sizeof(getattr(_lib, struct))
    fake_library_dir(*_stand_in(**{which: size + 8}))
    with pytest.raises(flashtile.LibraryNotAvailableError, match=rf"{struct} of {size + 8} bytes.*expects {size}"):
        _lib.lib()


# ---- require_kernel / KernelNotBuiltError with a substituted build config ----------------------------

def _fake_config(archs="80", dtypes="bf16", hdims="96;192x128", features="softcap", kernel_set="test"):
    return dict(abi_version=1, version=flashtile.__version__, kernel_set=kernel_set, archs=manifest._split(archs),
                dtypes=manifest._split(dtypes), head_dims=[list(p) for p in manifest.parse_hdims(hdims)],
                features=manifest._split(features), cuda_version="", cutlass_version="",
                kernels=manifest.enumerate_kernels(archs, dtypes, hdims, features))


@pytest.fixture
def use_config(monkeypatch, fresh_config):
    def use(cfg):
        monkeypatch.setattr(_lib, "installed_build_config", lambda: cfg)
        BC.build_config.cache_clear()
        return cfg
    return use


def _req(**kw):
    args = dict(op="fwd", dtype="bf16", head_dim=96, head_dim_v=96, band=False, softcap=False, path="auto")
    args.update(kw)
    return args


def test_require_kernel_buckets_head_dims(use_config):
    use_config(_fake_config())
    assert BC.require_kernel(**_req(head_dim=80, head_dim_v=80)) == ("ampere_fwd_bf16_hd96x96_none",)
    assert BC.require_kernel(**_req(head_dim=72, head_dim_v=72, band=True)) == ("ampere_fwd_bf16_hd96x96_band",)
    assert BC.require_kernel(**_req(head_dim=96, head_dim_v=96, softcap=True)) == ("ampere_fwd_bf16_hd96x96_none_softcap",)
    assert BC.require_kernel(**_req(head_dim=184, head_dim_v=120, band=True, softcap=True)) == (
        "ampere_fwd_bf16_hd192x128_band_softcap",)
    assert [k["name"] for k in BC.find_kernels(**_req(head_dim=136, head_dim_v=104))] == ["ampere_fwd_bf16_hd192x128_none"]
    assert BC.find_kernels(**_req(head_dim=64, head_dim_v=64)) == []  # bucket 64 was not built
    assert BC.find_kernels(**_req(head_dim=128, head_dim_v=128)) == []


def test_require_kernel_path_filter(use_config):
    use_config(_fake_config())
    assert BC.require_kernel(**_req(path="ampere")) == ("ampere_fwd_bf16_hd96x96_none",)
    assert BC.require_kernel(**_req(path="auto")) == ("ampere_fwd_bf16_hd96x96_none",)
    with pytest.raises(flashtile.KernelNotBuiltError, match=r"path=hopper"):
        BC.require_kernel(**_req(path="hopper"))


def test_kernel_not_built_message_lists_build(use_config):
    use_config(_fake_config())
    with pytest.raises(flashtile.KernelNotBuiltError) as info:
        BC.require_kernel(**_req(dtype="fp16", head_dim=80, head_dim_v=80, band=True))
    msg = str(info.value)
    assert "dtype=fp16 head_dim=80 (bucket 96) head_dim_v=80 mask=band softcap=False" in msg
    assert "kernel set 'test'" in msg and "['80']" in msg
    assert "fwd ampere bf16 hdim 96x96 [band, band+softcap, none, none+softcap]" in msg
    assert "fwd ampere bf16 hdim 192x128 [band, band+softcap, none, none+softcap]" in msg
    assert "FLASHTILE_DTYPES" in msg
    assert isinstance(info.value, NotImplementedError)


def test_kernel_not_built_for_missing_feature_and_hdim(use_config):
    use_config(_fake_config(hdims="128", features=""))
    with pytest.raises(flashtile.KernelNotBuiltError, match=r"softcap=True.*hdim 128x128 \[band, none\]"):
        BC.require_kernel(**_req(head_dim=128, head_dim_v=128, softcap=True))
    with pytest.raises(flashtile.KernelNotBuiltError, match=r"head_dim=256 \(bucket 256\)"):
        BC.require_kernel(**_req(head_dim=256, head_dim_v=256))


def test_empty_build_says_no_kernels(use_config):
    use_config(_fake_config(archs="", dtypes="", hdims="", features=""))
    with pytest.raises(flashtile.KernelNotBuiltError, match=r"has: no kernels"):
        BC.require_kernel(**_req())


def test_cache_clear_drops_config_and_lookups(use_config):
    use_config(_fake_config(dtypes="bf16"))
    assert BC.require_kernel(**_req())  # cached
    use_config(_fake_config(dtypes="fp16"))
    assert BC.build_config()["dtypes"] == ["fp16"]
    with pytest.raises(flashtile.KernelNotBuiltError):
        BC.require_kernel(**_req())
    assert BC.require_kernel(**_req(dtype="fp16")) == ("ampere_fwd_fp16_hd96x96_none",)


# ---- the installed library ---------------------------------------------------------------------------

def _installed():
    cfg_path = os.path.join(_lib.library_dir(), "build_config.json")
    if not (os.path.exists(_lib.library_path()) and os.path.exists(cfg_path)):
        return None
    with open(cfg_path) as f:
        return json.load(f)


INSTALLED = _installed()
needs_installed = pytest.mark.skipif(
    INSTALLED is None, reason=f"compiled library not installed in {_lib.library_dir()} (pip install . builds it)")


def _hdims_spec(head_dims):
    return ";".join(str(qk) if qk == v else f"{qk}x{v}" for qk, v in head_dims)


@needs_installed
def test_installed_library_embeds_installed_config(fresh_config):
    embedded = _lib.embedded_build_config()
    assert embedded == INSTALLED
    assert flashtile.build_config() == INSTALLED
    assert INSTALLED["abi_version"] == _lib.ABI_VERSION
    assert INSTALLED["version"] == flashtile.__version__


@needs_installed
def test_installed_config_matches_manifest():
    cfg = INSTALLED
    expected = manifest.enumerate_kernels(";".join(cfg["archs"]), ";".join(cfg["dtypes"]),
                                          _hdims_spec(cfg["head_dims"]), ";".join(cfg["features"]),
                                          ";".join(cfg["ops"]))
    assert cfg["kernels"] == expected
    assert cfg["kernels"], "the installed library has no kernels"
    assert cfg["kernel_set"] in manifest.KERNEL_SETS


@needs_installed
def test_installed_kernels_are_all_reachable(fresh_config):
    for k in INSTALLED["kernels"]:
        for path in ("auto", k["path"]):
            names = BC.require_kernel(op=k["op"], dtype=k["dtype"], head_dim=k["head_dim"], head_dim_v=k["head_dim_v"],
                                      band=k["mask"] == "band", softcap=k["softcap"], path=path)
            assert k["name"] in names


def _missing_request(cfg):
    """A request this build lacks: another dtype, else another head dim, else softcap, else the Hopper path."""
    built = {(k["dtype"], k["head_dim"], k["head_dim_v"], k["softcap"], k["path"]) for k in cfg["kernels"]}
    base = next(iter(sorted(built)))
    dtype, hd, hdv, softcap, _ = base
    for other in ("fp16", "bf16"):
        if not any(b[0] == other for b in built):
            return dict(dtype=other, head_dim=hd, head_dim_v=hdv, softcap=softcap, path="auto")
    for d in BC.HEAD_DIM_BUCKETS:
        if not any((b[0], b[1], b[2]) == (dtype, d, d) for b in built):
            return dict(dtype=dtype, head_dim=d, head_dim_v=d, softcap=False, path="auto")
    if not any(b[3] for b in built):
        return dict(dtype=dtype, head_dim=hd, head_dim_v=hdv, softcap=True, path="auto")
    if not any(b[4] == "hopper" for b in built):
        return dict(dtype=dtype, head_dim=hd, head_dim_v=hdv, softcap=False, path="hopper")
    return None


@needs_installed
def test_installed_kernel_not_built_names_the_build(fresh_config):
    req = _missing_request(INSTALLED)
    if req is None:
        pytest.skip("the installed build has every dtype, head dim, feature and path")
    with pytest.raises(flashtile.KernelNotBuiltError) as info:
        BC.require_kernel(op="fwd", band=False, **req)
    msg = str(info.value)
    assert f"dtype={req['dtype']}" in msg and f"path={req['path']}" in msg
    assert f"kernel set '{INSTALLED['kernel_set']}'" in msg
    for k in INSTALLED["kernels"]:
        assert f"fwd {k['path']} {k['dtype']} hdim {k['head_dim']}x{k['head_dim_v']} [" in msg


@pytest.fixture
def library_copy(tmp_path, monkeypatch, fresh_config):
    """A copy of the installed library in its own folder, loaded fresh."""
    shutil.copy(_lib.library_path(), tmp_path / "libflashtile.so")
    shutil.copy(os.path.join(_lib.library_dir(), "build_config.json"), tmp_path / "build_config.json")
    monkeypatch.setenv("FLASHTILE_LIBRARY_DIR", str(tmp_path))
    monkeypatch.setattr(_lib, "_lib", None)
    return tmp_path


@needs_installed
def test_loader_accepts_matching_copy(library_copy):
    assert _lib.lib() is not None
    assert _lib.embedded_build_config() == INSTALLED


@needs_installed
def test_loader_rejects_mismatched_build_config(library_copy):
    cfg = dict(INSTALLED, kernels=INSTALLED["kernels"][:-1])
    (library_copy / "build_config.json").write_text(json.dumps(cfg))
    with pytest.raises(flashtile.LibraryNotAvailableError, match=r"does not match its build_config\.json"):
        _lib.lib()
    assert _lib._lib is None


@needs_installed
def test_loader_rejects_missing_build_config(library_copy):
    os.remove(library_copy / "build_config.json")
    with pytest.raises(flashtile.LibraryNotAvailableError, match=r"build_config\.json is missing"):
        _lib.lib()


# ---- Ampere backward small-shared-memory tiles ----------------------------------------------------------

def _small_bwd_tiles():
    body = re.search(r"constexpr BwdTile ampere_bwd_tile_small\(int head_dim\) \{(.*?)\n\}", _header(TILE_POLICY_H), re.S).group(1)
    tiles = [tuple(int(x) for x in t.split(",")) for t in re.findall(r"BwdTile\{([^}]*)\}", body)]
    limits = [int(x) for x in re.findall(r"head_dim <= (\d+)", body)] + [256]
    return dict(zip(limits, tiles))


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_small_bwd_tile_fits_sm86_and_its_warp_layouts(d):
    # Mirrors BwdTraits::kSmemBytes: 16-bit Q/dO stages, K, V, P, dS, fp32 D and LSE per stage.
    bm, bn, warps, wm_sdp, wn_dkv, wm_dq, q_stages, _, _ = _small_bwd_tiles()[d]
    smem = 2 * (q_stages * 2 * bm * d + 2 * bn * d + 2 * bm * bn) + 4 * q_stages * 2 * bm
    assert smem <= 99 * 1024  # sm_86 / sm_89 per-block opt-in maximum
    assert bm % _lib.BWD_SEMAPHORE_ROWS == 0  # deterministic-mode semaphores are per 32 query rows
    assert 2 * bm <= 32 * warps  # one thread per row loads D and one the LSE
    # Each warp takes 16 x 16 per step of each GEMM: (bm, bn), (bn, d), (bm, d).
    for rows, cols, wm in ((bm, bn, wm_sdp), (bn, d, wn_dkv), (bm, d, wm_dq)):
        assert warps % wm == 0 and rows % (16 * wm) == 0 and cols % (16 * (warps // wm)) == 0


def _cmake_options():
    """(name, default) of every ft_option in cmake/options.cmake."""
    text = open(os.path.join(ROOT, "cmake", "options.cmake")).read()
    return re.findall(r'^ft_option\((FLASHTILE_\w+) "([^"]*)"', text, re.M)


def test_every_build_option_is_documented_with_its_default():
    readme = open(os.path.join(ROOT, "README.md")).read()
    rows = dict(re.findall(r"^\| `(FLASHTILE_\w+)` \| ([^|]+) \|", readme, re.M))
    options = _cmake_options()
    assert len(options) >= 10
    for name, default in options:
        assert name in rows, f"{name} is missing from README's build-option table"
        if default.startswith("-") or default in ("ON", "OFF"):
            assert rows[name].strip() == f"`{default}`", name


def test_tuning_overrides_reach_the_compiler_only_when_set():
    # cmake/options.cmake collects every option defaulting to -1 ("policy") in FT_OVERRIDE_OPTIONS, and
    # cmake/cuda_flags.cmake passes each only when set (not -1), so that the same macro given through
    # CMAKE_CUDA_FLAGS is not replaced by the default.
    options = open(os.path.join(ROOT, "cmake", "options.cmake")).read()
    assert re.search(r'if\("\$\{default\}" STREQUAL "-1"\)\s*list\(APPEND FT_OVERRIDE_OPTIONS \$\{name\}\)',
                     options), "ft_option no longer collects the -1 options"
    flags = open(os.path.join(ROOT, "cmake", "cuda_flags.cmake")).read()
    assert re.search(r"foreach\(opt \$\{FT_OVERRIDE_OPTIONS\}\)\s*if\(NOT \"\$\{\$\{opt\}\}\" STREQUAL \"-1\"\)\s*"
                     r"list\(APPEND FT_CUDA_FLAGS -D\$\{opt\}=\$\{\$\{opt\}\}\)", flags), \
        "cuda_flags.cmake no longer passes FT_OVERRIDE_OPTIONS to nvcc"


@pytest.mark.parametrize("name", [n for n, d in _cmake_options() if d == "-1"])
def test_tuning_override_has_the_policy_default_in_the_headers(name):
    # A -1 override is inert unless a header gives the macro the same default and reads it.
    headers = "".join(open(os.path.join(ROOT, d, f)).read() for d in ("common", "hopper", "ampere")
                      for f in os.listdir(os.path.join(ROOT, d)) if f.endswith(".h"))
    assert re.search(rf"#ifndef {name}\n#define {name} -1\n#endif", headers), name
    assert headers.count(name) >= 3, f"{name} is defined but never read"
