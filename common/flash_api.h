// flashtile's exported C ABI: the only symbols the shared library exposes.
//
// Contract: plain C types only, so the library carries no PyTorch or Python headers and one build
// serves every PyTorch/Python version (loaded with ctypes). Tensors are passed as raw device pointers
// plus element strides; the caller (python/flashtile/_lib.py) has validated shapes, dtypes and
// alignment. Every entry point returns 0 on success or a nonzero FtStatus; ft_last_error() then holds
// a message (thread-local). FT_ABI_VERSION changes whenever a struct below changes layout.
#pragma once

#include <stdint.h>

#if defined(_WIN32)
#define FT_EXPORT __declspec(dllexport)
#else
#define FT_EXPORT __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define FT_ABI_VERSION 8

typedef enum FtStatus {
  kFtOk = 0,
  kFtInvalidArgument = 1,
  kFtNotBuilt = 2,        // no kernel instance for this (path, dtype, hdim, mask, features)
  kFtUnsupportedDevice = 3,
  kFtCudaError = 4,
} FtStatus;

typedef enum FtDtype { kFtFloat16 = 0, kFtBFloat16 = 1, kFtFloat8E4M3 = 2 } FtDtype;

// Kernel family. kFtPathAuto picks Hopper on sm_90 when built, else the Ampere path.
typedef enum FtPath { kFtPathAuto = 0, kFtPathAmpere = 1, kFtPathHopper = 2 } FtPath;

// Forward pass arguments. Layouts (element strides, last dim contiguous):
//   padded: q (b, sq, h, d), k/v (b, sk, hk, d), out (b, sq, h, dv), lse (b, h, sq)
//   varlen (cu_seqlens_q != NULL): q (total_q, h, d), out (total_q, h, dv), lse (h, total_q);
//          batch strides are ignored for tensors whose cu_seqlens is set.
typedef struct FtFwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t lse_batch_stride, lse_head_stride;  // lse row stride is 1

  const int32_t* cu_seqlens_q;  // (b + 1) or NULL
  const int32_t* cu_seqlens_k;  // (b + 1) or NULL
  const int32_t* seqused_q;     // (b) or NULL: rows actually used per batch
  const int32_t* seqused_k;     // (b) or NULL
  // Scheduler workspace for ft_mha_fwd (ignored by ft_mha_bwd): FT_FWD_COUNTERS int32 of device
  // memory (the tile counter, then the tail split's per-tile counters). With tile_counter_zeroed = 0
  // any content and one per call in flight: a launch that reads it clears it first on the stream, one
  // that does not (2-CTA clusters without a split) leaves it as it was, so such a buffer never becomes
  // a zeroed one by being used; with 1 it holds zeros when the launch runs and every launch leaves it
  // zero (the kernel's last draw resets the tile counter, the last split of a tile its counter), so one
  // workspace serves all calls ordered on one stream (never two streams).
  int32_t* tile_counter;

  int32_t batch;
  int32_t seqlen_q;  // padded: per-batch length; varlen: max_seqlen_q
  int32_t seqlen_k;
  int32_t rows_q;    // rows in q's sequence dimension (padded: seqlen_q; varlen: total_q); TMA bounds
  int32_t rows_k;
  int32_t num_heads;
  int32_t num_heads_k;
  int32_t head_dim;    // actual d (multiple of 8); kernels handle d <= their bucket
  int32_t head_dim_v;

  float softmax_scale;
  float softcap;  // 0 = off
  // Band mask: key j is visible to query i iff  i + sk - sq - window_left <= j <= i + sk - sq + window_right
  // (bottom-right aligned). Negative = unbounded on that side. causal = (-1, 0).
  int32_t window_left;
  int32_t window_right;
  int32_t is_causal;

  int32_t dtype;  // FtDtype
  int32_t path;   // FtPath
  int32_t device;  // CUDA device ordinal of every tensor above
  // GQA packing of the Hopper forward (the query heads of a group in one tile): 0 = heuristic,
  // 1 = on where the group fits a tile, -1 = off. Other kernels ignore it.
  int32_t pack_gqa;
  int32_t tile_counter_zeroed;  // see tile_counter
  // Tail split of the Hopper forward (no band mask, fixed-length batches): the tiles of the grid's
  // last partial wave run split along the keys, and the split of a tile that finishes last combines
  // the splits' outputs (fp32) by their LSE. split_accum: fp32 scratch of split_accum_bytes, any
  // content; ft_fwd_split_accum_bytes(device, head_dim, head_dim_v) bytes cover every split a launch chooses,
  // fewer bytes (or NULL) limit or disable it. num_splits (FA3's): 0 = split the tail where the
  // launcher expects a gain, 1 = never split; other values are rejected.
  float* split_accum;
  int64_t split_accum_bytes;
  int32_t num_splits;
  int32_t reserved;
} FtFwdParams;

// int32 elements of FtFwdParams.tile_counter.
#define FT_FWD_COUNTERS 1024

// Backward pass arguments. `fwd` describes the forward call exactly as it was made (q, k, v, its output
// `out`, its `lse`, sequence geometry, mask, dtype, path, device). Gradient tensors use the layouts of
// the tensors they differentiate (dq like q, dk like k, dv like v, dout like out); the strides below are
// element strides with the last dim contiguous; varlen ignores batch strides as in the forward.
// Workspaces (fp32, caller-allocated, e.g. through PyTorch's caching allocator; no cudaMalloc here):
//   dq_accum:     head-major and padded so the main kernels add whole tiles without bounds checks, each
//                 head's rows contiguous (row stride = the head-dim bucket, 64/96/128/192/256, that
//                 its rows are rounded up to): padded: (batch, heads, round_up(seqlen_q,
//                 FT_BWD_ACCUM_ROW_PAD), d); varlen: (heads, total_q + FT_BWD_ACCUM_ROW_PAD * batch, d)
//                 with batch b's rows starting at cu_seqlens_q[b] + FT_BWD_ACCUM_ROW_PAD * b. Cleared
//                 whole by the backward; its element order within a head is the kernel's.
//   dsoftmax_sum: lse's layout; written by the backward (rowsum(dout * out) - dlse)
//   lse_log2:     lse's layout; written by the backward (lse * log2(e); +inf for rows without keys)
//   dq_semaphore: deterministic mode only (else NULL): int32, batch * num_heads *
//                 ceil(seqlen_q / FT_BWD_SEMAPHORE_ROWS) elements, zeroed by the caller
//   dq_done:      optional (NULL: the dq postprocess starts after the main kernel has finished): int32,
//                 batch * num_heads_k elements, cleared by the backward (with the accumulator in one
//                 memset when it starts right after dq_accum's extent). The Hopper main kernel counts
//                 there the CTAs whose dQ adds have landed, so that the postprocess of a head can run
//                 while the main kernel's last CTAs still run.
// Rows of dq/dk/dv outside every sequence (varlen gaps, rows past seqused_k) are not written: a caller
// that needs them defined zero-fills those tensors.
#define FT_BWD_SEMAPHORE_ROWS 32
#define FT_BWD_ACCUM_ROW_PAD 128

typedef struct FtBwdParams {
  FtFwdParams fwd;
  const void* dout;
  const float* dlse;  // gradient flowing into lse (lse's layout), or NULL for none
  void* dq;
  void* dk;
  void* dv;
  float* dq_accum;
  float* dsoftmax_sum;
  float* lse_log2;
  int32_t* dq_semaphore;
  int32_t* dq_done;

  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  int64_t dq_accum_batch_stride, dq_accum_row_stride, dq_accum_head_stride;

  // 1: dq accumulated in a fixed order (dq_semaphore required); 2: the same without rotated walks,
  // whose order needs all KV-block CTAs of a (batch, head) resident at once (for callers confined to a
  // part of the GPU's SMs; rotated walks are used only for at most half the SMs' worth of KV blocks).
  int32_t deterministic;
  int32_t reserved;
} FtBwdParams;

FT_EXPORT int ft_abi_version(void);
// sizeof(FtFwdParams) as compiled, so a caller can detect a layout mismatch at load time.
FT_EXPORT int ft_fwd_params_size(void);
FT_EXPORT int ft_bwd_params_size(void);
// JSON describing the kernels compiled into this library (same content as build_config.json).
FT_EXPORT const char* ft_build_config(void);
FT_EXPORT const char* ft_last_error(void);
// Bytes of FtFwdParams.split_accum that cover every tail split of a forward call with head dims
// (head_dim, head_dim_v) on `device` (0 where no kernel of that device and head dims splits).
FT_EXPORT int64_t ft_fwd_split_accum_bytes(int device, int head_dim, int head_dim_v);
// Enqueues the forward pass on `stream` (a cudaStream_t; NULL = legacy default stream).
FT_EXPORT int ft_mha_fwd(const FtFwdParams* params, void* stream);
// Enqueues the backward pass (preprocess, main kernel, postprocess) on `stream`.
FT_EXPORT int ft_mha_bwd(const FtBwdParams* params, void* stream);

#ifdef __cplusplus
}
#endif
