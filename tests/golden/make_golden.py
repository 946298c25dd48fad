#!/usr/bin/env python3
"""Generate the golden fixtures for kmla's MLA layer tests.

An independent PyTorch model of the layer's arithmetic (bf16 activations, rounding
at the points the vLLM layer rounds), written from the formulas in
shared/reference/vllm_mla_semantics.md and SPEC.md section 1b, not from kmla's C++.
It runs on the CPU (any torch >= 1.13; float8 dtypes are not needed: e4m3 and
bf16 rounding are done here by hand and, when torch has float8_e4m3fn, checked
against it).

Usage:  python3 tests/golden/make_golden.py [OUT_DIR]     (default: this folder)

tests/golden/README.md describes the files this writes.
"""

import json
import math
import os
import struct
import sys

import torch

KV_LORA = 512  # latent width
NOPE = 128
ROPE = 64
VDIM = 128
QK = NOPE + ROPE  # 192
LATENT = KV_LORA + ROPE  # 576
FP8_MAX = 448.0
ENTRY_BYTES = {"bf16": 2 * LATENT, "fp8": LATENT, "fp8_ds_mla": 656}

torch.set_num_threads(1)  # keeps float64 reductions in a fixed order


# --------------------------------------------------------------------------
# Rounding helpers.  Working tensors are float32/float64 holding values that
# are exactly representable in the format they stand for.
# --------------------------------------------------------------------------

def pow2(e):
    """2**e as float64 for integer tensor e (built from the exponent bits, exact)."""
    return ((e.long() + 1023) << 52).view(torch.float64)


def rbf(x):
    """Round to the nearest bf16 value (ties to even), returned as float32.

    Done on the float64 value with frexp, so a float64 sum is rounded once
    (a float64 -> float32 -> bf16 chain could round twice)."""
    m, e = torch.frexp(x.double())  # |m| in [0.5, 1)
    r = torch.round(m * 256.0) / 256.0  # 8 significant bits; torch.round is half-to-even
    return (r * pow2(e)).float()


def _e4m3_table():
    vals = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp = (code >> 3) & 0xF
        man = code & 0x7
        if exp == 15 and man == 7:
            v = float("nan")
        elif exp == 0:
            v = man * 2.0 ** -9
        else:
            v = (1.0 + man / 8.0) * 2.0 ** (exp - 7)
        vals.append(sign * v)
    return torch.tensor(vals, dtype=torch.float64)


E4M3 = _e4m3_table()  # code -> value
E4M3_POS = E4M3[:127].contiguous()  # codes 0x00..0x7E, ascending, 0 .. 448


def e4m3_encode(x):
    """float tensor, finite, |x| <= 448  ->  uint8 e4m3fn codes, nearest, ties to even."""
    assert torch.isfinite(x).all() and x.abs().max() <= FP8_MAX
    a = x.double().abs()
    hi = torch.searchsorted(E4M3_POS, a).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    d_lo = a - E4M3_POS[lo]
    d_hi = E4M3_POS[hi] - a
    # an even code has a zero mantissa LSB, so "even code" is round-half-to-even
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(take_hi, hi, lo)
    code = code | (torch.signbit(x).long() << 7)
    return code.to(torch.uint8)


def e4m3_value(codes):
    return E4M3[codes.long()]  # float64, exact


def fp8_saturate(x32):
    """The writers' clamp to +-448 before the e4m3 conversion (fp32)."""
    return torch.clamp(x32, -FP8_MAX, FP8_MAX)


def pow2_ceil(v):
    """Smallest power of two >= v (v > 0), exactly."""
    m, e = torch.frexp(v.double())
    p = torch.where(m == 0.5, v.double(), pow2(e))
    return p.float()


# --------------------------------------------------------------------------
# Little-endian byte packing (cache rows and safetensors payloads).
# --------------------------------------------------------------------------

def bf16_to_bytes(x):
    x = x.float()
    bits = x.view(torch.int32).long()
    assert (bits & 0xFFFF).eq(0).all(), "value is not bf16-representable"
    h = (bits >> 16) & 0xFFFF
    return torch.stack([h & 0xFF, h >> 8], -1).reshape(*x.shape[:-1], -1).to(torch.uint8)


def int_to_bytes(x, nbytes):
    x = x.long()
    parts = [(x >> (8 * k)) & 0xFF for k in range(nbytes)]
    return torch.stack(parts, -1).reshape(*x.shape[:-1], -1).to(torch.uint8)


def f32_to_bytes(x):
    return int_to_bytes(x.float().view(torch.int32), 4)


def bytes_to_bf16(b):
    b = b.long()
    h = b[..., 0::2] | (b[..., 1::2] << 8)
    v = h << 16
    v = torch.where(v >= 2 ** 31, v - 2 ** 32, v)
    return v.to(torch.int32).view(torch.float32)


def bytes_to_f32(b):
    b = b.long()
    v = b[..., 0::4] | (b[..., 1::4] << 8) | (b[..., 2::4] << 16) | (b[..., 3::4] << 24)
    v = torch.where(v >= 2 ** 31, v - 2 ** 32, v)
    return v.to(torch.int32).view(torch.float32)


# --------------------------------------------------------------------------
# Layer pieces
# --------------------------------------------------------------------------

def gemm(x, w):
    """x [M, in] @ w[out, in].T: exact float64 sum (an ideal fp32 accumulator), bf16 out."""
    return rbf(x.double() @ w.double().t())


def rmsnorm(x, w, eps):
    """fp32 math, one rounding: x * rsqrt(mean(x^2) + eps) * w."""
    x32 = x.float()
    var = (x32.double() ** 2).mean(-1, keepdim=True).float()
    r = torch.rsqrt(var + torch.tensor(eps, dtype=torch.float32))
    return rbf(x32 * r * w.float())


def yarn_get_mscale(scale, m):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rope_inv_freq(cfg, dtype):
    """Per-pair frequency (32 values); dtype float32 for the table, float64 for the check."""
    base = float(cfg["rope_theta"])
    exps = torch.arange(0, ROPE, 2, dtype=dtype) / ROPE
    if cfg["rope_type"] == "default":
        return 1.0 / (base ** exps)
    assert cfg["rope_type"] == "deepseek_yarn"
    factor = float(cfg["factor"])
    orig = cfg["original_max_position_embeddings"]
    pos_freqs = base ** exps
    inv_extrap = 1.0 / pos_freqs
    inv_interp = 1.0 / (factor * pos_freqs)

    def corr_dim(rot):
        return ROPE * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(cfg["beta_fast"])), 0)
    high = min(math.ceil(corr_dim(cfg["beta_slow"])), ROPE - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(ROPE // 2, dtype=dtype) - low) / (high - low), 0, 1)
    mask = (1 - ramp) * cfg["extrapolation_factor"]
    return inv_interp * (1 - mask) + inv_extrap * mask


def rope_rot_scale(cfg):
    if cfg["rope_type"] != "deepseek_yarn":
        return 1.0
    f = cfg["factor"]
    return (yarn_get_mscale(f, cfg["mscale"]) / yarn_get_mscale(f, cfg["mscale_all_dim"])
            * cfg["attn_factor"])


def rope_table_rows(cfg):
    if cfg["rope_type"] == "deepseek_yarn":
        return int(cfg["original_max_position_embeddings"] * cfg["factor"])
    return cfg["max_position_embeddings"]


def rope_cos_sin(cfg, positions, dtype=torch.float32):
    """Rows of the cos/sin table, [len(positions), 64] = [cos(p f_i) | sin(p f_i)].

    float32: built like the fp32 table (fp32 product p*f_i, fp32 cos/sin, times the
    rotation mscale).  float64: the same in float64, for the self-check."""
    assert (positions >= 0).all() and (positions < rope_table_rows(cfg)).all()
    inv_freq = rope_inv_freq(cfg, dtype)
    ang = positions.to(dtype)[:, None] * inv_freq[None, :]
    ms = rope_rot_scale(cfg)
    return torch.cat([ang.cos() * ms, ang.sin() * ms], -1)


def rope_apply(x, cs):
    """Interleaved (GPT-J) rotation of the last dim (64) in cs's precision.
    x [..., 64]; cs [..., 64] broadcastable. Pair i = (x[2i], x[2i+1])."""
    dt = cs.dtype
    x = x.to(dt)
    cos, sin = cs[..., :ROPE // 2], cs[..., ROPE // 2:]
    a, b = x[..., 0::2], x[..., 1::2]
    ra = a * cos - b * sin
    rb = a * sin + b * cos
    return torch.stack([ra, rb], -1).reshape(x.shape)


# ---- latent cache rows ----

def encode_rows(fmt, kv, pe, k_scale):
    """kv [N, 512] (bf16 values), pe [N, 64] -> uint8 [N, entry_bytes].
    pe holds bf16 values, except for the plain fp8 format where it is the fp32
    rotated value (that path quantizes without a bf16 rounding)."""
    if fmt == "bf16":
        return torch.cat([bf16_to_bytes(kv), bf16_to_bytes(pe)], -1)
    if fmt == "fp8":
        inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(k_scale, dtype=torch.float32)
        x = torch.cat([kv.float(), pe.float()], -1) * inv
        return e4m3_encode(fp8_saturate(x))
    assert fmt == "fp8_ds_mla"
    n = kv.shape[0]
    tiles = kv.float().reshape(n, 4, 128)
    amax = tiles.abs().amax(-1)
    v = torch.maximum(amax / FP8_MAX, torch.tensor(1e-4, dtype=torch.float32))
    scale = pow2_ceil(v)  # [n, 4]
    codes = e4m3_encode(fp8_saturate(tiles / scale[..., None])).reshape(n, KV_LORA)
    return torch.cat([codes, f32_to_bytes(scale), bf16_to_bytes(pe)], -1)


def decode_rows(fmt, rows, k_scale):
    """uint8 [N, entry] -> (kv [N,512], pe [N,64]) as the readers dequantize them
    (float32 holding bf16 values; plain fp8 gives float(code) * k_scale in fp32)."""
    if fmt == "bf16":
        v = bytes_to_bf16(rows)
        return v[:, :KV_LORA], v[:, KV_LORA:]
    if fmt == "fp8":
        v = e4m3_value(rows).float() * torch.tensor(k_scale, dtype=torch.float32)
        return v[:, :KV_LORA], v[:, KV_LORA:]
    codes = e4m3_value(rows[:, :KV_LORA]).float().reshape(-1, 4, 128)
    scale = bytes_to_f32(rows[:, KV_LORA:KV_LORA + 16])
    kv = rbf(codes * scale[..., None]).reshape(-1, KV_LORA)
    pe = bytes_to_bf16(rows[:, KV_LORA + 16:])
    return kv, pe


def decode_rows_exact(fmt, rows, k_scale):
    """Float64 values of cache rows, no rounding (for the self-check)."""
    if fmt == "bf16":
        return bytes_to_bf16(rows).double()
    if fmt == "fp8":
        return e4m3_value(rows) * k_scale
    codes = e4m3_value(rows[:, :KV_LORA]).reshape(-1, 4, 128)
    scale = bytes_to_f32(rows[:, KV_LORA:KV_LORA + 16]).double()
    kv = (codes * scale[..., None]).reshape(-1, KV_LORA)
    return torch.cat([kv, bytes_to_bf16(rows[:, KV_LORA + 16:]).double()], -1)


def poisoned_cache(fmt, num_blocks, bs):
    """NaN bytes everywhere: bf16 0x7FC0, e4m3 0x7F, fp32 scales 0x7FC00000."""
    if fmt == "bf16":
        row = torch.tensor([0xC0, 0x7F] * LATENT, dtype=torch.uint8)
    elif fmt == "fp8":
        row = torch.full((LATENT,), 0x7F, dtype=torch.uint8)
    else:
        row = torch.cat([torch.full((KV_LORA,), 0x7F, dtype=torch.uint8),
                         torch.tensor([0x00, 0x00, 0xC0, 0x7F] * 4, dtype=torch.uint8),
                         torch.tensor([0xC0, 0x7F] * ROPE, dtype=torch.uint8)])
    return row.repeat(num_blocks, bs, 1).contiguous()


# --------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------

def base_config(**kw):
    cfg = dict(
        kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        v_head_dim=VDIM, q_lora_rank=0, use_rope=False, rope_type="default",
        rope_theta=10000.0, factor=1.0, original_max_position_embeddings=4096,
        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0, attn_factor=1.0,
        extrapolation_factor=1.0, max_position_embeddings=4096, rms_norm_eps=1e-5,
        use_output_gate=False, non_causal_multi_token_decode=False,
        cache_format="bf16", ds_mla_scale_rule="pow2", block_size=16, k_scale=1.0,
        q_scale=1.0, num_padding_rows=2, spare_blocks=2)
    cfg.update(kw)
    return cfg


CASES = [
    base_config(
        name="k3", seed=1001, hidden_size=256, num_heads=3, q_lora_rank=96,
        use_output_gate=True, cache_format="bf16", rms_norm_eps=1e-5,
        max_position_embeddings=1048576,
        query_lens=[1, 1, 2, 7, 9], context_lens=[37, 20, 29, 21, 0],
        position_offsets=[0, 0, 0, 0, 0], decode_threshold=2),
    base_config(
        name="dspark", seed=1002, hidden_size=256, num_heads=2, q_lora_rank=96,
        use_rope=True, rope_type="default", rope_theta=50000.0,
        non_causal_multi_token_decode=True, cache_format="fp8_ds_mla",
        max_position_embeddings=4096,
        query_lens=[1, 1, 3, 6, 8], context_lens=[50, 17, 29, 19, 0],
        position_offsets=[0, 0, 0, 0, 0], decode_threshold=3),
    base_config(
        name="kimi_linear", seed=1003, hidden_size=192, num_heads=3, q_lora_rank=0,
        cache_format="fp8", k_scale=0.5, q_scale=0.25, max_position_embeddings=1048576,
        query_lens=[1, 1, 3, 7, 9], context_lens=[41, 16, 30, 23, 0],
        position_offsets=[0, 0, 0, 0, 0], decode_threshold=3),
    base_config(
        name="k2_yarn", seed=1004, hidden_size=256, num_heads=2, q_lora_rank=96,
        use_rope=True, rope_type="deepseek_yarn", rope_theta=50000.0, factor=32.0,
        original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
        mscale=1.0, mscale_all_dim=1.0, max_position_embeddings=131072,
        cache_format="bf16", rms_norm_eps=1e-6,
        query_lens=[1, 1, 2, 7, 9], context_lens=[37, 20, 29, 21, 0],
        # RoPE positions far into the table (it has 4096*32 = 131072 rows); the
        # offset only moves the RoPE position, not the cache position.
        position_offsets=[100003, 120011, 131000, 99990, 131050], decode_threshold=2),
]


def softmax_scale(cfg):
    s = QK ** -0.5
    if cfg["use_rope"] and cfg["rope_type"] == "deepseek_yarn":
        m = yarn_get_mscale(cfg["factor"], cfg["mscale_all_dim"])
        s *= m * m
    return s


def make_weights(cfg, g):
    hs, H, ql = cfg["hidden_size"], cfg["num_heads"], cfg["q_lora_rank"]

    def lin(out_f, in_f):
        return rbf(torch.randn(out_f, in_f, generator=g, dtype=torch.float64) / math.sqrt(in_f))

    def norm_w(n):
        return rbf(1.0 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64))

    w = {}
    if ql:
        w["q_a_proj"] = lin(ql, hs)
        w["q_a_layernorm"] = norm_w(ql)
        w["q_b_proj"] = lin(H * QK, ql)
    else:
        w["q_proj"] = lin(H * QK, hs)
    w["kv_a_proj_with_mqa"] = lin(LATENT, hs)
    w["kv_a_layernorm"] = norm_w(KV_LORA)
    w["kv_b_proj"] = lin(H * (NOPE + VDIM), KV_LORA)
    if cfg["use_output_gate"]:
        w["g_proj"] = lin(H * VDIM, hs)
    w["o_proj"] = lin(hs, H * VDIM)
    return w


def make_batch(cfg, g):
    """Block tables, slots, positions and the initial (poisoned + context) cache."""
    bs = cfg["block_size"]
    qlens, clens = cfg["query_lens"], cfg["context_lens"]
    thr = cfg["decode_threshold"]
    kinds = ["decode" if q <= thr and c > 0 else ("context" if c > 0 else "fresh")
             for q, c in zip(qlens, clens)]
    order = {"decode": 0, "context": 1, "fresh": 2}
    assert [order[k] for k in kinds] == sorted(order[k] for k in kinds), "batch order"
    seq = [q + c for q, c in zip(qlens, clens)]
    nblk = [-(-s // bs) for s in seq]
    num_blocks = sum(nblk) + cfg["spare_blocks"]
    perm = torch.randperm(num_blocks, generator=g)
    bt = torch.full((len(seq), max(nblk)), -1, dtype=torch.int32)
    k = 0
    for r, n in enumerate(nblk):
        bt[r, :n] = perm[k:k + n].int()
        k += n

    def slot_of(r, cache_pos):
        return int(bt[r, cache_pos // bs]) * bs + cache_pos % bs

    T = sum(qlens)
    rows = T + cfg["num_padding_rows"]
    positions = torch.zeros(rows, dtype=torch.int64)
    slots = torch.full((rows,), -1, dtype=torch.int64)
    req_of_token = []
    t = 0
    for r, (q, c) in enumerate(zip(qlens, clens)):
        for i in range(q):
            positions[t] = cfg["position_offsets"][r] + c + i
            slots[t] = slot_of(r, c + i)
            req_of_token.append(r)
            t += 1

    fmt = cfg["cache_format"]
    cache = poisoned_cache(fmt, num_blocks, bs)
    return dict(kinds=kinds, seq=seq, block_table=bt, num_blocks=num_blocks,
                positions=positions, slots=slots, T=T, rows=rows, cache=cache,
                slot_of=slot_of)


def fill_context(cfg, batch, w, g):
    """Random, validly encoded latent rows for every cached context position."""
    bs = cfg["block_size"]
    cache = batch["cache"]
    for r, c in enumerate(cfg["context_lens"]):
        if c == 0:
            continue
        kv = rbf(torch.randn(c, KV_LORA, generator=g, dtype=torch.float64)
                 * w["kv_a_layernorm"].double())
        pe = rbf(torch.randn(c, ROPE, generator=g, dtype=torch.float64))
        enc = encode_rows(cfg["cache_format"], kv, pe, cfg["k_scale"])
        for j in range(c):
            s = batch["slot_of"](r, j)
            cache[s // bs, s % bs] = enc[j]


def gather_rows(cache, bt_row, n, bs):
    """Cache rows of cache positions 0..n-1 of one request."""
    idx = torch.arange(n)
    blocks = bt_row[(idx // bs)].long()
    return cache[blocks, idx % bs]


def kv_b_heads(w, H):
    """Per-head [k_nope rows (128, 512)], [v rows (128, 512)] of kv_b_proj."""
    kb = w["kv_b_proj"].reshape(H, NOPE + VDIM, KV_LORA)
    return kb[:, :NOPE], kb[:, NOPE:]


# --------------------------------------------------------------------------
# The bf16 pipeline (what the fixtures hold)
# --------------------------------------------------------------------------

def forward(cfg, w, hidden, batch):
    H, T, bs = cfg["num_heads"], batch["T"], cfg["block_size"]
    fmt, k_scale, q_scale = cfg["cache_format"], cfg["k_scale"], cfg["q_scale"]
    scale = softmax_scale(cfg)
    h = hidden[:T]

    # 1. front end
    if cfg["q_lora_rank"]:
        ql = cfg["q_lora_rank"]
        fused = gemm(h, torch.cat([w["q_a_proj"], w["kv_a_proj_with_mqa"]], 0))
        q_c, kv_c, k_pe = fused[:, :ql], fused[:, ql:ql + KV_LORA], fused[:, ql + KV_LORA:]
        q_c = rmsnorm(q_c, w["q_a_layernorm"], cfg["rms_norm_eps"])
        q = gemm(q_c, w["q_b_proj"]).reshape(T, H, QK)
    else:
        q = gemm(h, w["q_proj"]).reshape(T, H, QK)
        kva = gemm(h, w["kv_a_proj_with_mqa"])
        kv_c, k_pe = kva[:, :KV_LORA], kva[:, KV_LORA:]
    kvn = rmsnorm(kv_c, w["kv_a_layernorm"], cfg["rms_norm_eps"])
    q_nope, q_pe = q[..., :NOPE], q[..., NOPE:]

    # 2. RoPE: fp32 values (fed straight to plain-fp8 quantization) and bf16 values
    cs = None
    if cfg["use_rope"]:
        cs = rope_cos_sin(cfg, batch["positions"][:T])
        q_pe32 = rope_apply(q_pe, cs[:, None, :])
        k_pe32 = rope_apply(k_pe, cs)
    else:
        q_pe32, k_pe32 = q_pe.float(), k_pe.float()
    q_pe_bf, k_pe_bf = rbf(q_pe32), rbf(k_pe32)

    # 3. cache write
    cache = batch["cache"].clone()
    slots = batch["slots"][:T]
    enc = encode_rows(fmt, kvn, k_pe32 if fmt == "fp8" else k_pe_bf, k_scale)
    for t in range(T):
        s = int(slots[t])
        if s >= 0:
            cache[s // bs, s % bs] = enc[t]

    W_UK, W_UV = kv_b_heads(w, H)
    attn = torch.zeros(T, H, VDIM, dtype=torch.float32)
    inv_q = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(q_scale, dtype=torch.float32)
    t0 = 0
    for r, kind in enumerate(batch["kinds"]):
        qn, cn, S = cfg["query_lens"][r], cfg["context_lens"][r], batch["seq"][r]
        toks = slice(t0, t0 + qn)
        t0 += qn
        if kind == "decode":
            # 4. absorbed MQA over the cache as it is after this step's writes
            rows = gather_rows(cache, batch["block_table"][r], S, bs)
            if fmt == "fp8":
                K = e4m3_value(rows)  # codes as values; the descales multiply the score
                V = (K[:, :KV_LORA].float() * torch.tensor(k_scale, dtype=torch.float32)).double()
            else:
                kv, pe = decode_rows(fmt, rows, k_scale)
                K = torch.cat([kv, pe], -1).double()
                V = kv.double()
            assert torch.isfinite(K).all() and torch.isfinite(V).all(), "read a poisoned row"
            if cfg["non_causal_multi_token_decode"]:
                limit = torch.full((qn,), S)
            else:
                limit = S - (qn - 1 - torch.arange(qn))
            mask = torch.arange(S)[None, :] < limit[:, None]
            for hd in range(H):
                ql_nope = rbf(q_nope[toks, hd].double() @ W_UK[hd].double())  # [qn, 512]
                if fmt == "fp8":
                    Q32 = torch.cat([ql_nope, q_pe32[toks, hd]], -1)
                    Q = e4m3_value(e4m3_encode(fp8_saturate(Q32 * inv_q)))
                    s_ = (scale * q_scale * k_scale) * (Q @ K.t())
                else:
                    Q = torch.cat([ql_nope, q_pe_bf[toks, hd]], -1).double()
                    s_ = scale * (Q @ K.t())
                p = torch.softmax(s_.masked_fill(~mask, -math.inf), -1)
                latent = rbf(p @ V)
                attn[toks, hd] = rbf(latent.double() @ W_UV[hd].double().t())
        else:
            # 5. MHA: cached context (dequantized to bf16) + own new tokens, causal
            if cn:
                rows = gather_rows(cache, batch["block_table"][r], cn, bs)
                kv_ctx, pe_ctx = decode_rows(fmt, rows, k_scale)
                kv_ctx = rbf(kv_ctx)  # plain fp8: bf16(float(code) * k_scale)
                pe_ctx = rbf(pe_ctx)
                assert torch.isfinite(kv_ctx).all() and torch.isfinite(pe_ctx).all()
            else:
                kv_ctx = torch.zeros(0, KV_LORA)
                pe_ctx = torch.zeros(0, ROPE)
            kvb = gemm(torch.cat([kv_ctx, kvn[toks]], 0), w["kv_b_proj"]).reshape(-1, H, NOPE + VDIM)
            pe_all = torch.cat([pe_ctx, k_pe_bf[toks]], 0)
            mask = torch.arange(cn + qn)[None, :] <= (cn + torch.arange(qn))[:, None]
            for hd in range(H):
                K = torch.cat([kvb[:, hd, :NOPE], pe_all], -1).double()
                V = kvb[:, hd, NOPE:].double()
                Q = torch.cat([q_nope[toks, hd], q_pe_bf[toks, hd]], -1).double()
                p = torch.softmax((scale * (Q @ K.t())).masked_fill(~mask, -math.inf), -1)
                attn[toks, hd] = rbf(p @ V)
    attn_out = attn.reshape(T, H * VDIM)

    # 6. gate and output projection
    gated = attn_out
    if cfg["use_output_gate"]:
        gate = gemm(h, w["g_proj"])
        gated = rbf(attn_out.float() * torch.sigmoid(gate.float()))
    out = torch.zeros(batch["rows"], cfg["hidden_size"], dtype=torch.float32)
    out[:T] = gemm(gated, w["o_proj"])
    return dict(out=out, cache_out=cache, q=q, kv_c_normed=kvn, k_pe=k_pe,
                attn_out=attn_out, cos_sin=cs)


# --------------------------------------------------------------------------
# Self-check: float64, no intermediate rounding, un-absorbed MHA for every token.
# Cached rows (context and this step's decode tokens) are read from the pipeline's
# cache_out, dequantized exactly; prefill tokens use their own float64 latents.
# --------------------------------------------------------------------------

def forward_f64(cfg, w, hidden, batch, cache_out):
    H, T, bs = cfg["num_heads"], batch["T"], cfg["block_size"]
    fmt, k_scale = cfg["cache_format"], cfg["k_scale"]
    scale = softmax_scale(cfg)
    W = {k: v.double() for k, v in w.items()}
    h = hidden[:T].double()
    eps = cfg["rms_norm_eps"]

    def rms(x, wt):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * wt

    if cfg["q_lora_rank"]:
        q = (rms(h @ W["q_a_proj"].t(), W["q_a_layernorm"]) @ W["q_b_proj"].t()).reshape(T, H, QK)
    else:
        q = (h @ W["q_proj"].t()).reshape(T, H, QK)
    kva = h @ W["kv_a_proj_with_mqa"].t()
    kvn, k_pe = rms(kva[:, :KV_LORA], W["kv_a_layernorm"]), kva[:, KV_LORA:]
    q_pe = q[..., NOPE:]
    if cfg["use_rope"]:
        cs = rope_cos_sin(cfg, batch["positions"][:T], torch.float64)
        q_pe = rope_apply(q_pe, cs[:, None, :])
        k_pe = rope_apply(k_pe, cs)
    Qfull = torch.cat([q[..., :NOPE], q_pe], -1)
    kb = W["kv_b_proj"].reshape(H, NOPE + VDIM, KV_LORA)

    attn = torch.zeros(T, H, VDIM, dtype=torch.float64)
    t0 = 0
    for r, kind in enumerate(batch["kinds"]):
        qn, cn, S = cfg["query_lens"][r], cfg["context_lens"][r], batch["seq"][r]
        toks = slice(t0, t0 + qn)
        t0 += qn
        if kind == "decode":
            lat = decode_rows_exact(fmt, gather_rows(cache_out, batch["block_table"][r], S, bs), k_scale)
            if cfg["non_causal_multi_token_decode"]:
                mask = torch.ones(qn, S, dtype=torch.bool)
            else:
                mask = torch.arange(S)[None, :] <= (cn + torch.arange(qn))[:, None]
        else:
            ctx = decode_rows_exact(fmt, gather_rows(cache_out, batch["block_table"][r], cn, bs), k_scale)
            lat = torch.cat([ctx, torch.cat([kvn[toks], k_pe[toks]], -1)], 0)
            mask = torch.arange(cn + qn)[None, :] <= (cn + torch.arange(qn))[:, None]
        for hd in range(H):
            k_nope = lat[:, :KV_LORA] @ kb[hd, :NOPE].t()
            v = lat[:, :KV_LORA] @ kb[hd, NOPE:].t()
            K = torch.cat([k_nope, lat[:, KV_LORA:]], -1)
            p = torch.softmax((scale * (Qfull[toks, hd] @ K.t())).masked_fill(~mask, -math.inf), -1)
            attn[toks, hd] = p @ v
    attn_out = attn.reshape(T, H * VDIM)
    gated = attn_out
    if cfg["use_output_gate"]:
        gated = attn_out * torch.sigmoid(h @ W["g_proj"].t())
    return dict(out=gated @ W["o_proj"].t(), attn_out=attn_out)


# --------------------------------------------------------------------------
# safetensors (written by hand: 8-byte LE header length, JSON header, payload)
# --------------------------------------------------------------------------

def tensor_bytes(dtype, t):
    flat = t.reshape(-1)
    if dtype == "BF16":
        b = bf16_to_bytes(flat.reshape(-1, 1))
    elif dtype == "F32":
        b = f32_to_bytes(flat.reshape(-1, 1))
    elif dtype == "I64":
        b = int_to_bytes(flat.reshape(-1, 1), 8)
    elif dtype == "I32":
        b = int_to_bytes(flat.reshape(-1, 1), 4)
    elif dtype == "U8":
        b = flat.to(torch.uint8)
    else:
        raise ValueError(dtype)
    return bytes(b.reshape(-1).tolist())


def save_safetensors(path, tensors, metadata):
    header = {"__metadata__": metadata}
    blobs, offset = [], 0
    for name in sorted(tensors):
        dtype, t = tensors[name]
        data = tensor_bytes(dtype, t)
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)


def load_safetensors_raw(path):
    """name -> (dtype, shape, bytes); plus the metadata dict. For the round-trip check."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        payload = f.read()
    meta = header.pop("__metadata__")
    out = {k: (v["dtype"], v["shape"], payload[v["data_offsets"][0]:v["data_offsets"][1]])
           for k, v in header.items()}
    return out, meta


# --------------------------------------------------------------------------
# Checks of the hand-written rounding against torch's own conversions
# --------------------------------------------------------------------------

def check_rounding():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(200000, generator=g) * torch.exp2(torch.randint(-20, 20, (200000,), generator=g).float())
    # bf16 midpoints: exact ties between neighbours must go to even
    b = torch.randn(50000, generator=g).to(torch.bfloat16).float()
    bits = b.view(torch.int32)
    ties = (bits + 0x8000).view(torch.float32)
    x = torch.cat([x, ties, torch.tensor([0.0, -0.0, 1e-30, -3.0e38])])
    assert torch.equal(rbf(x).view(torch.int32), x.to(torch.bfloat16).float().view(torch.int32)), \
        "rbf differs from torch bf16 rounding"
    msg = "bf16 rounding matches torch"
    xb = x[:1000].to(torch.bfloat16)
    assert torch.equal(bf16_to_bytes(xb.float().reshape(-1, 1)), xb.view(torch.uint8).reshape(-1, 2))
    assert torch.equal(bytes_to_bf16(xb.view(torch.uint8).reshape(-1, 2)).reshape(-1), xb.float())
    xf = x[:1000].contiguous()
    assert torch.equal(f32_to_bytes(xf.reshape(-1, 1)), xf.view(torch.uint8).reshape(-1, 4))
    assert torch.equal(bytes_to_f32(xf.view(torch.uint8).reshape(-1, 4)).reshape(-1), xf)
    msg += "; byte packing matches torch's memory layout"
    if hasattr(torch, "float8_e4m3fn"):
        table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
        same = (table == E4M3) | (table.isnan() & E4M3.isnan())
        assert same.all(), "e4m3 value table differs from torch"
        y = (torch.randn(200000, generator=g) * torch.exp2(torch.randint(-12, 9, (200000,), generator=g).float()))
        pos = E4M3_POS.float()
        mids = (pos[1:] + pos[:-1]) / 2  # exact in fp32
        y = torch.cat([y, mids, -mids, pos, -pos, torch.tensor([0.0, -0.0, 1e-12, -1e-12])])
        y = fp8_saturate(y)
        ref = y.to(torch.float8_e4m3fn).view(torch.uint8)
        mine = e4m3_encode(y)
        bad = (ref != mine).sum().item()
        assert bad == 0, f"e4m3 encoder differs from torch on {bad} values"
        msg += "; e4m3 encoder matches torch.float8_e4m3fn on %d values" % y.numel()
    else:
        msg += "; torch has no float8_e4m3fn here, e4m3 encoder not cross-checked"
    print(msg)


# --------------------------------------------------------------------------

def run_case(cfg, out_dir):
    g = torch.Generator().manual_seed(cfg["seed"])
    w = make_weights(cfg, g)
    batch = make_batch(cfg, g)
    fill_context(cfg, batch, w, g)
    hidden = rbf(torch.randn(batch["rows"], cfg["hidden_size"], generator=g, dtype=torch.float64))
    res = forward(cfg, w, hidden, batch)
    T, bs = batch["T"], cfg["block_size"]

    # sanity: padding rows are zero; the cache changed only at written slots
    assert res["out"][T:].eq(0).all()
    changed = (res["cache_out"] != batch["cache"]).any(-1).reshape(-1)
    written = torch.zeros_like(changed)
    written[batch["slots"][batch["slots"] >= 0]] = True
    assert not (changed & ~written).any(), "cache changed outside the written slots"
    assert torch.isfinite(res["out"]).all()

    ref = forward_f64(cfg, w, hidden, batch, res["cache_out"])
    d_out = (res["out"][:T].double() - ref["out"]).abs().max().item()
    m_out = ref["out"].abs().max().item()
    d_att = (res["attn_out"].double() - ref["attn_out"]).abs().max().item()
    m_att = ref["attn_out"].abs().max().item()

    meta_cfg = {k: cfg[k] for k in (
        "name", "hidden_size", "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "use_rope", "rope_type", "rope_theta", "factor",
        "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
        "mscale_all_dim", "attn_factor", "extrapolation_factor", "max_position_embeddings",
        "rms_norm_eps", "use_output_gate", "non_causal_multi_token_decode", "cache_format",
        "ds_mla_scale_rule", "block_size", "k_scale", "q_scale", "decode_threshold",
        "query_lens", "context_lens", "position_offsets", "seed")}
    meta_cfg.update(
        softmax_scale=softmax_scale(cfg),
        num_blocks=batch["num_blocks"], entry_bytes=ENTRY_BYTES[cfg["cache_format"]],
        num_actual_tokens=T, num_rows=batch["rows"], request_kinds=batch["kinds"],
        rope_table_rows=rope_table_rows(cfg) if cfg["use_rope"] else 0,
        selfcheck_out_max_abs_diff=d_out, selfcheck_out_max_abs=m_out,
        selfcheck_attn_out_max_abs_diff=d_att, selfcheck_attn_out_max_abs=m_att)

    tensors = {name: ("BF16", t) for name, t in w.items()}
    tensors.update(
        hidden=("BF16", hidden),
        positions=("I64", batch["positions"]),
        slot_mapping=("I64", batch["slots"]),
        block_table=("I32", batch["block_table"]),
        cache_in=("U8", batch["cache"]),
        cache_out=("U8", res["cache_out"]),
        out=("BF16", res["out"]),
        q=("BF16", res["q"]),
        kv_c_normed=("BF16", res["kv_c_normed"]),
        k_pe=("BF16", res["k_pe"]),
        attn_out=("BF16", res["attn_out"]),
    )
    if res["cos_sin"] is not None:
        tensors["rope_cos_sin"] = ("F32", res["cos_sin"])
    path = os.path.join(out_dir, cfg["name"] + ".safetensors")
    save_safetensors(path, tensors, {"config": json.dumps(meta_cfg)})

    # round trip through our reader, and through the safetensors package if present
    raw, meta = load_safetensors_raw(path)
    assert json.loads(meta["config"])["name"] == cfg["name"]
    for name, (dtype, t) in tensors.items():
        assert raw[name][0] == dtype and raw[name][1] == list(t.shape)
        assert raw[name][2] == tensor_bytes(dtype, t)
    try:
        from safetensors import safe_open
    except ImportError:
        safe_open = None
    if safe_open is not None:
        with safe_open(path, framework="pt") as f:
            assert json.loads(f.metadata()["config"])["num_rows"] == batch["rows"]
            for name, (dtype, t) in tensors.items():
                got = f.get_tensor(name)
                if dtype == "BF16":
                    assert torch.equal(got.float(), t.float()), name
                else:
                    assert torch.equal(got.to(t.dtype), t), name

    print(f"{cfg['name']:12s} file {os.path.getsize(path):8d} B  tokens {T:2d} rows {batch['rows']:2d}"
          f"  kinds {batch['kinds']}  scale {softmax_scale(cfg):.7f}")
    print(f"{'':12s} self-check vs float64 un-absorbed: out max|diff| {d_out:.3e} (max|out| {m_out:.3e}),"
          f" attn_out max|diff| {d_att:.3e} (max|attn_out| {m_att:.3e})")
    return d_out, m_out


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    os.makedirs(out_dir, exist_ok=True)
    print("torch", torch.__version__)
    check_rounding()
    for cfg in CASES:
        run_case(cfg, out_dir)
    if "safetensors" in sys.modules:
        print("safetensors package read every file back identically")


if __name__ == "__main__":
    main()
