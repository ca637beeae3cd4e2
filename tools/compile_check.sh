#!/usr/bin/env bash
# Compile-only check (front end + cicc to PTX, no ptxas, no GPU) of kernel instances that a small build
# leaves out: the Hopper (sm_90a) forward and backward at d = 256 and (192, 128), whose tiles and code
# paths differ most from d = 128 (block_n 80 / 96, the backward's column-split schedule and dQ passes),
# the backward at d = 96, whose dQ GEMM splits 48 columns per warpgroup, d = 192, and the softcap band
# kernels at d = 128 (development builds leave softcap out).
# Usage: tools/compile_check.sh [CUTLASS include dir]; default: the nvidia-cutlass Python package's.
set -euo pipefail
cd "$(dirname "$0")/.."
inc=${1:-$(python3 -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))")}
gen=$(mktemp -d)
trap 'rm -rf "$gen"' EXIT
python3 cmake/manifest.py --out "$gen" --archs 90a --dtypes bf16 --hdims "256;192x128;96;192;128" --features "softcap" --ops "fwd;bwd" >/dev/null
# The flags of cmake/cuda_flags.cmake that change what is compiled.
flags=(-std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -DNDEBUG -DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL
       -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -gencode=arch=compute_90a,code=sm_90a -I. -I"$gen" -I"$inc")
for k in hopper_fwd_bf16_hd256x256_none hopper_fwd_bf16_hd192x128_band hopper_bwd_bf16_hd256x256_band \
         hopper_bwd_bf16_hd192x128_none hopper_bwd_bf16_hd96x96_band hopper_fwd_bf16_hd192x192_band \
         hopper_bwd_bf16_hd192x192_none hopper_fwd_bf16_hd128x128_band_softcap hopper_bwd_bf16_hd128x128_band_softcap; do
  t0=$(date +%s)
  nvcc "${flags[@]}" -ptx "$gen/kernels/$k.cu" -o "$gen/$k.ptx"
  echo "compile check: $k ok ($(( $(date +%s) - t0 )) s)"
done
