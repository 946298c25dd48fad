// fp32 attention for the CPU backend: absorbed MQA decode over the paged latent cache,
// variable-length prefill attention (qk 192, v 128) and the LSE merge.
//
// Both attention paths are one loop: a block of query rows meets the keys block by block
// with an online softmax (running max m, running sum l, unnormalised accumulator acc),
// each block being two sgemm calls (scores = Q K^T, acc += P V). The blocking bounds every
// scratch buffer independently of the sequence length:
//   decode : scores <= 256 rows x 512 keys, one dequantised key block 512 x 576 (1.2 MB)
//   prefill: scores <= 128 rows x 512 keys, acc 128 x 128
// The softmax is exact fp32 arithmetic in a different order than a one-pass softmax, which
// stays far inside the act (bf16/f16) rounding that every output goes through.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu/kernels.hpp"
#include "cpu/parallel.hpp"
#include "kmla/error.hpp"

namespace kmla::cpu {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Decode: keys per block and query rows (token x head) per task.
constexpr int64_t kDecodeKeyBlock = 512;
constexpr int64_t kDecodeRowChunk = 256;
// Prefill: query rows per task and keys per block.
constexpr int64_t kPrefillQueryBlock = 128;
constexpr int64_t kPrefillKeyBlock = 512;

// Online-softmax update of nq query rows with one block of keys. Row i sees the first
// vis[i] keys of the block. Q [nq, dqk], K [*, dqk], V [*, dv] with the given row strides;
// m, l [nq] and acc [nq, dv] (row stride ldacc) carry the running state; S is scratch for
// nq x max(vis) scores.
void attend_block(const float* Q, int64_t ldq, int64_t nq, int64_t dqk, const float* K, int64_t ldk,
                  const float* V, int64_t ldv, int64_t dv, const int64_t* vis, float scale,
                  float* m, float* l, float* acc, int64_t ldacc, float* S) {
  int64_t nk = 0;
  for (int64_t i = 0; i < nq; ++i) nk = std::max(nk, vis[i]);
  if (nk == 0) return;
  gemm_nt(nq, nk, dqk, Q, ldq, K, ldk, S, nk, scale);
  for (int64_t i = 0; i < nq; ++i) {
    float* s = S + i * nk;
    const int64_t v = vis[i];
    float mx = kNegInf;
    for (int64_t j = 0; j < v; ++j) mx = std::fmax(mx, s[j]);
    const float m_new = std::fmax(m[i], mx);
    if (v <= 0 || m_new == kNegInf) {  // nothing visible in this block: P row = 0
      std::memset(s, 0, size_t(nk) * sizeof(float));
      continue;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < v; ++j) {
      s[j] = std::exp(s[j] - m_new);
      sum += s[j];
    }
    for (int64_t j = v; j < nk; ++j) s[j] = 0.0f;
    if (m[i] != m_new) {
      const float corr = std::exp(m[i] - m_new);  // 0 when m[i] is -inf (first block)
      l[i] *= corr;
      float* a = acc + i * ldacc;
      for (int64_t d = 0; d < dv; ++d) a[d] *= corr;
    }
    l[i] += sum;
    m[i] = m_new;
  }
  gemm_nn(nq, dv, nk, S, nk, V, ldv, acc, ldacc, 1.0f, 1.0f);
}

// acc / l and m + log(l); an untouched row (m = -inf) has no keys: zeros and -inf.
void finish_row(float m, float l, const float* acc, int64_t dv, float* out, float* lse) {
  if (m == kNegInf) {
    std::memset(out, 0, size_t(dv) * sizeof(float));
    *lse = kNegInf;
    return;
  }
  for (int64_t d = 0; d < dv; ++d) out[d] = acc[d] / l;
  *lse = m + std::log(l);
}

}  // namespace

// ---- decode -------------------------------------------------------------------------

void decode_attention_f32(const float* q, int heads, const LatentCache& cache,
                          const BatchMetadata& md, float scale, float* out, float* lse,
                          int threads) {
  const int64_t H = heads;
  // A unit of work: query rows [row0, row1) (global token*H + head rows) of decode request
  // r against its keys [key0, key1). A request is split over keys (and merged afterwards)
  // only when there are too few requests to keep the threads busy.
  struct Chunk {
    int r;
    int64_t row0, row1;
    int first_split, num_splits;
  };
  struct Split {
    int chunk;
    int64_t key0, key1;
    int64_t state;  // offset (in rows) into the m / l / acc state arrays
  };
  std::vector<Chunk> chunks;
  for (int r = 0; r < md.num_decodes; ++r) {
    const int64_t begin = md.query_start[r] * H, end = md.query_start[r + 1] * H;
    for (int64_t row = begin; row < end; row += kDecodeRowChunk)
      chunks.push_back({r, row, std::min(end, row + kDecodeRowChunk), 0, 0});
  }
  if (chunks.empty()) return;
  const int64_t want_splits =
      (2 * int64_t(threads) + int64_t(chunks.size()) - 1) / int64_t(chunks.size());
  std::vector<Split> splits;
  int64_t state_rows = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    Chunk& ch = chunks[c];
    const int64_t S = md.seq_lens[ch.r];
    const int64_t blocks = (S + kDecodeKeyBlock - 1) / kDecodeKeyBlock;
    const int64_t n = std::max<int64_t>(1, std::min(want_splits, blocks));
    ch.first_split = int(splits.size());
    ch.num_splits = int(n);
    for (int64_t s = 0; s < n; ++s) {
      const int64_t b0 = s * blocks / n, b1 = (s + 1) * blocks / n;
      splits.push_back({int(c), std::min(S, b0 * kDecodeKeyBlock),
                        std::min(S, b1 * kDecodeKeyBlock), state_rows});
      state_rows += ch.row1 - ch.row0;
    }
  }
  std::vector<float> m(size_t(state_rows), kNegInf), l(size_t(state_rows), 0.0f);
  std::vector<float> acc(size_t(state_rows) * kKvLoraRank, 0.0f);

  struct Scratch {
    std::vector<float> keys, scores;
    std::vector<int64_t> vis;
  };
  const int workers = int(std::min<int64_t>(std::max(threads, 1), int64_t(splits.size())));
  std::vector<Scratch> scratch{size_t(workers)};
  const RowCodec codec = cache.codec();

  parallel_for(int64_t(splits.size()), workers, [&](int64_t si, int worker) {
    const Split& sp = splits[size_t(si)];
    const Chunk& ch = chunks[size_t(sp.chunk)];
    Scratch& sc = scratch[size_t(worker)];
    const int64_t nq = ch.row1 - ch.row0;
    sc.keys.resize(size_t(kDecodeKeyBlock) * kLatentDim);
    sc.scores.resize(size_t(nq) * kDecodeKeyBlock);
    sc.vis.resize(size_t(nq));
    const int64_t token0 = md.query_start[ch.r];
    for (int64_t kb = sp.key0; kb < sp.key1; kb += kDecodeKeyBlock) {
      const int64_t n = std::min(kDecodeKeyBlock, sp.key1 - kb);
      for (int64_t j = 0; j < n; ++j)
        codec.decode(cache.slot_ptr(md.slot_of(ch.r, kb + j)), sc.keys.data() + j * kLatentDim);
      for (int64_t i = 0; i < nq; ++i) {
        const int token = int((ch.row0 + i) / H - token0);
        const int64_t count = md.decode_key_count(ch.r, token);
        sc.vis[size_t(i)] = std::clamp<int64_t>(count - kb, 0, n);
      }
      attend_block(q + ch.row0 * kLatentDim, kLatentDim, nq, kLatentDim, sc.keys.data(), kLatentDim,
                   sc.keys.data(), kLatentDim, kKvLoraRank, sc.vis.data(), scale,
                   m.data() + sp.state, l.data() + sp.state, acc.data() + sp.state * kKvLoraRank,
                   kKvLoraRank, sc.scores.data());
    }
  });

  // Merge each chunk's splits (a single split is just normalised).
  for (const Chunk& ch : chunks) {
    const int64_t nq = ch.row1 - ch.row0;
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t row = ch.row0 + i;
      float M = kNegInf;
      for (int s = 0; s < ch.num_splits; ++s)
        M = std::fmax(M, m[size_t(splits[size_t(ch.first_split + s)].state + i)]);
      float* o = out + row * kKvLoraRank;
      if (ch.num_splits == 1) {
        const int64_t st = splits[size_t(ch.first_split)].state + i;
        finish_row(m[size_t(st)], l[size_t(st)], acc.data() + st * kKvLoraRank, kKvLoraRank, o,
                   lse + row);
        continue;
      }
      if (M == kNegInf) {
        finish_row(M, 0.0f, nullptr, kKvLoraRank, o, lse + row);
        continue;
      }
      float L = 0.0f;
      std::memset(o, 0, kKvLoraRank * sizeof(float));
      for (int s = 0; s < ch.num_splits; ++s) {
        const int64_t st = splits[size_t(ch.first_split + s)].state + i;
        if (m[size_t(st)] == kNegInf) continue;
        const float w = std::exp(m[size_t(st)] - M);
        L += l[size_t(st)] * w;
        const float* a = acc.data() + st * kKvLoraRank;
        for (int d = 0; d < kKvLoraRank; ++d) o[d] += a[d] * w;
      }
      for (int d = 0; d < kKvLoraRank; ++d) o[d] /= L;
      lse[row] = M + std::log(L);
    }
  }
}

// ---- prefill ------------------------------------------------------------------------

void prefill_attention_f32(const PrefillProblem& p, int threads) {
  const std::vector<int64_t>& cu_q = *p.cu_q;
  const std::vector<int64_t>& cu_k = *p.cu_k;
  const int64_t num_seqs = int64_t(cu_q.size()) - 1;
  struct Task {
    int64_t seq;
    int head;
    int64_t q0, q1;  // query rows within the sequence
  };
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t nq = cu_q[s + 1] - cu_q[s];
    for (int h = 0; h < p.heads; ++h)
      for (int64_t q0 = 0; q0 < nq; q0 += kPrefillQueryBlock)
        tasks.push_back({s, h, q0, std::min(nq, q0 + kPrefillQueryBlock)});
  }
  struct Scratch {
    std::vector<float> m, l, acc, scores;
    std::vector<int64_t> vis;
  };
  const int workers =
      int(std::min<int64_t>(std::max(threads, 1), std::max<int64_t>(1, int64_t(tasks.size()))));
  std::vector<Scratch> scratch{size_t(workers)};

  parallel_for(int64_t(tasks.size()), workers, [&](int64_t ti, int worker) {
    const Task& t = tasks[size_t(ti)];
    Scratch& sc = scratch[size_t(worker)];
    const int64_t nq_seq = cu_q[t.seq + 1] - cu_q[t.seq];
    const int64_t nk = cu_k[t.seq + 1] - cu_k[t.seq];
    const int64_t nq = t.q1 - t.q0;
    sc.m.assign(size_t(nq), kNegInf);
    sc.l.assign(size_t(nq), 0.0f);
    sc.acc.assign(size_t(nq) * kVDim, 0.0f);
    sc.scores.resize(size_t(nq) * kPrefillKeyBlock);
    sc.vis.resize(size_t(nq));
    // Keys visible to query row qi of the sequence (bottom-right aligned when causal).
    auto visible = [&](int64_t qi) {
      return p.causal ? std::clamp<int64_t>(nk - nq_seq + qi + 1, 0, nk) : nk;
    };
    const int64_t last = visible(t.q1 - 1);  // the most any row of the block sees
    const int64_t q_row0 = cu_q[t.seq] + t.q0;
    const float* Q = p.q.ptr + q_row0 * p.q.row_stride + t.head * p.q.head_stride;
    const float* K = p.k.ptr + cu_k[t.seq] * p.k.row_stride + t.head * p.k.head_stride;
    const float* V = p.v.ptr + cu_k[t.seq] * p.v.row_stride + t.head * p.v.head_stride;
    for (int64_t kb = 0; kb < last; kb += kPrefillKeyBlock) {
      const int64_t n = std::min(kPrefillKeyBlock, last - kb);
      for (int64_t i = 0; i < nq; ++i)
        sc.vis[size_t(i)] = std::clamp<int64_t>(visible(t.q0 + i) - kb, 0, n);
      attend_block(Q, p.q.row_stride, nq, kQkHeadDim, K + kb * p.k.row_stride, p.k.row_stride,
                   V + kb * p.v.row_stride, p.v.row_stride, kVDim, sc.vis.data(), p.scale,
                   sc.m.data(), sc.l.data(), sc.acc.data(), kVDim, sc.scores.data());
    }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t row = q_row0 + i;
      finish_row(sc.m[size_t(i)], sc.l[size_t(i)], sc.acc.data() + i * kVDim, kVDim,
                 p.out + row * p.out_row_stride + t.head * p.out_head_stride,
                 p.lse + row * p.lse_row_stride + t.head);
    }
  });
}

// ---- merge --------------------------------------------------------------------------

void merge_attn_f32(const float* prefix, const float* prefix_lse, const float* suffix,
                    const float* suffix_lse, int64_t rows, int64_t rows_with_prefix, int heads,
                    int dim, float* out, float* out_lse, DType round) {
  for (int64_t t = 0; t < rows; ++t) {
    for (int h = 0; h < heads; ++h) {
      const int64_t i = t * heads + h;
      const float* so = suffix + i * dim;
      float* o = out + i * dim;
      float s_lse = suffix_lse[i];
      if (t >= rows_with_prefix) {
        if (o != so)
          for (int d = 0; d < dim; ++d) o[d] = round_value(so[d], round);
        if (out_lse) out_lse[i] = s_lse;
        continue;
      }
      const float* po = prefix + i * dim;  // the prefix has only rows_with_prefix rows
      float p_lse = prefix_lse[i];
      // +-inf both mean "no keys" (some kernels report +inf for an empty row).
      if (std::isinf(p_lse)) p_lse = kNegInf;
      if (std::isinf(s_lse)) s_lse = kNegInf;
      const float mx = std::fmax(p_lse, s_lse);
      if (mx == kNegInf) {
        if (o != po)
          for (int d = 0; d < dim; ++d) o[d] = round_value(po[d], round);
        if (out_lse) out_lse[i] = kNegInf;
        continue;
      }
      const float pe = std::exp(p_lse - mx), se = std::exp(s_lse - mx);
      const float sum = pe + se;
      const float pw = pe / sum, sw = se / sum;
      for (int d = 0; d < dim; ++d) o[d] = round_value(po[d] * pw + so[d] * sw, round);
      if (out_lse) out_lse[i] = std::log(sum) + mx;
    }
  }
}

}  // namespace kmla::cpu
