"""Per-kernel SASS summary of libflashtile.so: matrix instructions, TMA, register reallocation and
local-memory traffic (spills), from `cuobjdump -sass`. Usage: python tools/sass_report.py LIB [FILTER]."""
import collections
import re
import subprocess
import sys

PATTERNS = {"HGMMA": r"\bHGMMA\.", "QGMMA": r"\bQGMMA\.", "HMMA": r"\bHMMA\.", "LDSM": r"\bLDSM\b",
            "LDGSTS": r"\bLDGSTS\b", "UTMALDG": r"\bUTMALDG\b", "UTMASTG": r"\bUTMASTG\b", "USETMAXREG": r"\bUSETMAXREG\b",
            "LDL": r"\bLDL\b", "STL": r"\bSTL\b"}


def main(argv):
    lib, filt = argv[1], (argv[2] if len(argv) > 2 else "")
    sass = subprocess.run(["cuobjdump", "-sass", lib], capture_output=True, text=True, check=True).stdout
    counts, arch, name = collections.OrderedDict(), "?", None
    for line in sass.splitlines():
        m = re.search(r"arch = (sm_\w+)", line)
        if m:
            arch = m.group(1)
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = (arch, m.group(1))
            counts[name] = collections.Counter()
            continue
        if name:
            for key, pat in PATTERNS.items():
                if re.search(pat, line):
                    counts[name][key] += 1
    for (arch, fn), c in counts.items():
        demangled = subprocess.run(["c++filt", fn], capture_output=True, text=True).stdout.strip()
        short = re.sub(r"flashtile::|cutlass::|cute::", "", demangled)[:110]
        if filt in short:
            print(f"{arch:6s} {short}\n       " + " ".join(f"{k}={c[k]}" for k in PATTERNS if c[k] or k in ("LDL", "STL")))


if __name__ == "__main__":
    main(sys.argv)
