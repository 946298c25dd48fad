// Operand layouts of the prefill tests, shared by the 16-bit (test_prefill.cu) and the fp8
// (test_prefill_fp8.cu) ones: E is the element code type (uint16_t or uint8_t).
//
// Dense: q [T, H, 192], k_nope and v [T, H, 128] in buffers of their own, k_rope [T, 64]
// (shared by all heads) or [T, H, 64], out [T, H, 128], lse [T, H].
// Strided (what a whole layer hands the kernel): q rows of stride H*192 + 64 starting 32
// elements into the buffer (a wider fused projection output); k_nope and v the two halves of
// one [T, H, 256] kv_b output; a shared k_rope at column 512 of a [T, 576] latent row, a
// per-head k_rope in rows of H*64 + R from offset R (R = 16 bytes, the TMA alignment); out
// with head stride 136 and row stride H*136 + 8; lse row stride H + 3.
// Every element of an input buffer that is not an operand element, rows past the last token
// included, holds the poison code.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda/attention.cuh"
#include "cuda/gpu.hpp"

namespace kmla::test {

// One [rows, heads, width] operand inside a host buffer of E codes.
template <class E>
struct PrefillOperand {
  std::vector<E>* buf;
  int64_t offset, row_stride, head_stride;
  int width;
  int64_t at(int64_t t, int h, int d) const {
    return offset + t * row_stride + int64_t(h) * head_stride + d;
  }
};

template <class E>
struct PrefillLayout {
  static constexpr int kQk = 192, kNope = 128, kRope = 64, kV = 128;
  static constexpr int64_t kRopePad = 16 / int64_t(sizeof(E));

  std::vector<E> q_buf, kv_buf, v_buf, rope_buf;
  PrefillOperand<E> q, k_nope, v, k_rope;
  int64_t out_head_stride, out_row_stride, lse_row_stride;
  bool strided;

  // Buffers for q_rows query rows and k_rows key rows, filled with `poison`.
  PrefillLayout(int H, bool strided_, bool shared_rope, int64_t q_rows, int64_t k_rows, E poison)
      : strided(strided_) {
    const bool L = strided;
    const int64_t h = H;
    q = {&q_buf, L ? 32 : 0, L ? h * kQk + 64 : h * kQk, kQk, kQk};
    k_nope = {&kv_buf, 0, h * (L ? 256 : kNope), L ? 256 : kNope, kNope};
    v = L ? PrefillOperand<E>{&kv_buf, 128, h * 256, 256, kV}
          : PrefillOperand<E>{&v_buf, 0, h * kV, kV, kV};
    if (shared_rope)
      k_rope = L ? PrefillOperand<E>{&rope_buf, 512, 576, 0, kRope}
                 : PrefillOperand<E>{&rope_buf, 0, kRope, 0, kRope};
    else
      k_rope = L ? PrefillOperand<E>{&rope_buf, kRopePad, h * kRope + kRopePad, kRope, kRope}
                 : PrefillOperand<E>{&rope_buf, 0, h * kRope, kRope, kRope};
    out_head_stride = L ? 136 : kV;
    out_row_stride = L ? h * 136 + 8 : h * kV;
    lse_row_stride = L ? h + 3 : h;
    q_buf.assign(size_t(q.offset + q_rows * q.row_stride), poison);
    kv_buf.assign(size_t(k_rows * k_nope.row_stride), poison);
    if (!L) v_buf.assign(size_t(k_rows * v.row_stride), poison);
    rope_buf.assign(size_t(k_rope.offset + k_rows * k_rope.row_stride), poison);
  }
};

// A layout's inputs on the device, outputs for q_rows rows (16-bit out, fp32 lse) and the
// PrefillParams that point into them (operands, outputs, heads, sequences); the caller sets
// max_q_len, causal, softmax_scale, act and the fp8 fields.
template <class E>
struct PrefillBuffers {
  DevBuf<E> q, kv, v, rope;
  DevBuf<int32_t> cu_q, cu_k;
  DevBuf<uint16_t> out;
  DevBuf<float> lse;
  cuda::PrefillParams params;

  PrefillBuffers(const PrefillLayout<E>& l, int heads, const std::vector<int32_t>& cu_q_,
                 const std::vector<int32_t>& cu_k_, int64_t q_rows)
      : q(l.q_buf),
        kv(l.kv_buf),
        v(l.strided ? std::vector<E>(16) : l.v_buf),
        rope(l.rope_buf),
        cu_q(cu_q_),
        cu_k(cu_k_),
        out(size_t(q_rows * l.out_row_stride)),
        lse(size_t(q_rows * l.lse_row_stride)) {
    auto operand = [](const E* base, const PrefillOperand<E>& o) {
      return cuda::Operand{base + o.offset, o.row_stride, o.head_stride};
    };
    params.q = operand(q.ptr, l.q);
    params.k_nope = operand(kv.ptr, l.k_nope);
    params.k_rope = operand(rope.ptr, l.k_rope);
    params.v = operand(l.strided ? kv.ptr : v.ptr, l.v);
    params.out = out.ptr;
    params.out_row_stride = l.out_row_stride;
    params.out_head_stride = l.out_head_stride;
    params.lse = lse.ptr;
    params.lse_row_stride = l.lse_row_stride;
    params.heads = heads;
    params.cu_q = cu_q.ptr;
    params.cu_k = cu_k.ptr;
    params.num_seqs = int(cu_q_.size()) - 1;
  }
};

}  // namespace kmla::test
