"""Per-kernel SASS summary of libflashtile.so (or a .o / .cubin): matrix instructions, TMA, register
reallocation and local-memory traffic (spills), from `cuobjdump -sass`. With --loops, also the
innermost loop that issues two or more HGMMA (the KV loop of a forward, the step loop of a backward):
its instruction count, HGMMA, MUFU.EX2 and R2UR (values moved from vector to uniform registers, e.g.
GMMA descriptors that left the uniform datapath).
Usage: python tools/sass_report.py LIB [FILTER] [--loops]"""
import collections
import re
import subprocess
import sys

PATTERNS = {"HGMMA": r"\bHGMMA\.", "QGMMA": r"\bQGMMA\.", "HMMA": r"\bHMMA\.", "LDSM": r"\bLDSM\b",
            "LDGSTS": r"\bLDGSTS\b", "UTMALDG": r"\bUTMALDG\b", "UTMASTG": r"\bUTMASTG\b", "USETMAXREG": r"\bUSETMAXREG\b",
            "LDL": r"\bLDL\b", "STL": r"\bSTL\b"}
INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")


def gmma_loops(instrs):
    """(size, HGMMA, MUFU.EX2, R2UR) of each backward branch's body holding >= 2 HGMMA, smallest first."""
    index = {addr: i for i, (addr, _) in enumerate(instrs)}
    loops = set()
    for i, (addr, text) in enumerate(instrs):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= addr or int(m.group(1), 16) not in index:
            continue
        body = [t for _, t in instrs[index[int(m.group(1), 16)]:i + 1]]
        hgmma = sum("HGMMA" in t for t in body)
        if hgmma >= 2:
            loops.add((len(body), hgmma, sum("MUFU.EX2" in t for t in body),
                       sum(re.search(r"\bR2UR\b", t) is not None for t in body)))
    return sorted(loops)


def main(argv):
    loops = "--loops" in argv
    argv = [a for a in argv if a != "--loops"]
    lib, filt = argv[1], (argv[2] if len(argv) > 2 else "")
    sass = subprocess.run(["cuobjdump", "-sass", lib], capture_output=True, text=True, check=True).stdout
    counts, instrs, arch, name = collections.OrderedDict(), {}, "?", None
    for line in sass.splitlines():
        m = re.search(r"arch = (sm_\w+)", line)
        if m:
            arch = m.group(1)
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = (arch, m.group(1))
            counts[name], instrs[name] = collections.Counter(), []
            continue
        if name:
            for key, pat in PATTERNS.items():
                if re.search(pat, line):
                    counts[name][key] += 1
            m = INSTR.search(line)
            if m:
                instrs[name].append((int(m.group(1), 16), m.group(2)))
    for (arch, fn), c in counts.items():
        demangled = subprocess.run(["c++filt", fn], capture_output=True, text=True).stdout.strip()
        short = re.sub(r"flashtile::|cutlass::|cute::", "", demangled)[:110]
        if filt in short:
            print(f"{arch:6s} {short}\n       " + " ".join(f"{k}={c[k]}" for k in PATTERNS if c[k] or k in ("LDL", "STL")))
            if loops:
                for size, hgmma, ex2, r2ur in gmma_loops(instrs[(arch, fn)])[:1]:
                    print(f"       inner loop: {size} instructions, HGMMA={hgmma} MUFU.EX2={ex2} R2UR={r2ur}")


if __name__ == "__main__":
    main(sys.argv)
