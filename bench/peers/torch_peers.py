#!/usr/bin/env python3
"""PyTorch peers of `kmla bench`, measured on the same GPU with the same conventions.

  python3 bench/peers/torch_peers.py --json OUT.json [--iters 20] [--warmup 3] [--only SUBSTR]

What it measures (SPEC §4):
  * copy bandwidth: a 2 GiB device-to-device copy (cudaMemcpyAsync), bytes read + written,
    median of 10 runs;
  * prefill attention, qk 192 / v 128, causal, bf16, batch 1, at 8192x64, 8192x16 and 32768x16
    (tokens x heads), through torch.nn.functional.scaled_dot_product_attention with one backend
    forced at a time: cuDNN first (the peer SPEC names), then FLASH_ATTENTION and
    EFFICIENT_ATTENTION. A backend that refuses v != qk head dims is retried with v padded to
    192 (the padding is done before timing and the row says so). Each row names the backend
    that ran and the CUDA kernel the profiler saw;
  * the whole Kimi-K3 layer at 12 local heads (TP 8), composed of torch ops (cuBLAS GEMMs,
    fp32 RMSNorms, cache write, SDPA on the best backend, sigmoid gate, o_proj): an 8192-token
    prefill, and an absorbed decode step of 128 requests x 8192 keys that gathers the paged
    cache and uses plain matmuls (a naive composition: a reference point, not a peer kernel).

Timing: CUDA events around each run, an L2 flush before each timed run and outside it (a read
of 2x the L2 size, which leaves clean lines, as `kmla bench` does; --write-flush fills the
buffer instead), median of --iters runs after --warmup untimed ones.
FLOPs: decode 2*B*q*H*S*(576+512); prefill attention 2*H*(192+128)*pairs (T(T+1)/2 causal);
GEMMs 2*rows*in*out each; decode bytes B*S*1152 (bf16 cache).
"""

import argparse
import datetime
import json
import math
import sys

import torch
import torch.nn.functional as F

BF16 = torch.bfloat16
KV_LORA, ROPE, NOPE, VDIM = 512, 64, 128, 128
LATENT = KV_LORA + ROPE  # 576
QK = NOPE + ROPE  # 192
SCALE = QK ** -0.5

# Kimi-K3 (MlaConfig::preset("kimi-k3")) sliced to TP 8.
K3 = dict(hidden=7168, heads=12, q_lora=1536, eps=1e-5)


# ---- the measuring conventions (the same formulas as src/bench/bench.cu) ----------------

def decode_flops(b, q, h, s):
    """Per (query row, head, key): a 576-wide QK and a 512-wide PV product."""
    return 2.0 * b * q * h * s * (LATENT + KV_LORA)


def decode_bytes(b, s, entry_bytes=1152):
    """Each request's cache rows read once (V is the first 512 columns of K)."""
    return float(b) * s * entry_bytes


def prefill_pairs(t, causal=True):
    return t * (t + 1) / 2.0 if causal else float(t) * t


def prefill_flops(h, pairs):
    """A 192-wide QK and a 128-wide PV product per (query, key) pair and head."""
    return 2.0 * h * (QK + VDIM) * pairs


def layer_projection_flops(rows, hidden, heads, q_lora, absorbed):
    """2*rows*in*out per GEMM of the q-LoRA layer with an output gate."""
    m = float(rows)
    f = 2 * m * hidden * (q_lora + LATENT)  # fused front end
    f += 2 * m * q_lora * heads * QK  # q_b
    if absorbed:
        f += 2 * m * heads * NOPE * KV_LORA  # q_nope . W_UK_T
        f += 2 * m * heads * KV_LORA * VDIM  # latent . W_UV
    else:
        f += 2 * m * KV_LORA * heads * (NOPE + VDIM)  # kv_b
    f += 2 * m * hidden * heads * VDIM  # g_proj
    f += 2 * m * heads * VDIM * hidden  # o_proj
    return f


# ---- timing ------------------------------------------------------------------------------

class Timer:
    """CUDA-event timing with an L2 flush before every timed run (not inside it)."""

    def __init__(self, warmup, iters, write_flush=False):
        props = torch.cuda.get_device_properties(0)
        l2 = getattr(props, "L2_cache_size", 0) or (128 << 20)
        self.flush = torch.ones(max(2 * l2, 64 << 20), dtype=torch.uint8, device="cuda")
        self.write_flush = write_flush
        self.warmup, self.iters = warmup, iters
        self.start = torch.cuda.Event(enable_timing=True)
        self.stop = torch.cuda.Event(enable_timing=True)

    def median_us(self, fn, warmup=None, iters=None):
        warmup = self.warmup if warmup is None else warmup
        iters = self.iters if iters is None else iters
        for _ in range(warmup):
            fn()
        times = []
        for i in range(max(iters, 1)):
            if self.write_flush:
                self.flush.fill_(i & 1)
            else:
                self.flush.sum()  # reads every byte, writes one scalar
            self.start.record()
            fn()
            self.stop.record()
            self.stop.synchronize()
            times.append(self.start.elapsed_time(self.stop) * 1e3)
        times.sort()
        n = len(times)
        return times[n // 2] if n % 2 else 0.5 * (times[n // 2 - 1] + times[n // 2])


def copy_bandwidth_gb_s(timer):
    nbytes = 2 << 30
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    us = timer.median_us(lambda: dst.copy_(src), warmup=2, iters=10)
    del src, dst
    torch.cuda.empty_cache()
    return 2.0 * nbytes / (us * 1e-6) / 1e9


def cuda_kernels(fn):
    """What one call of fn ran, from the profiler (best effort): the SDPA dispatch op(s) that
    name the backend, then the CUDA kernels, most device time first."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels, ops = [], []
        for e in prof.key_averages():
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = getattr(e, "self_cuda_time_total", 0)
            if str(getattr(e, "device_type", "")).endswith("CUDA"):
                if t > 0:
                    kernels.append((t, e.key))
            elif e.key.startswith("aten::_scaled_dot_product") or e.key.startswith("aten::_flash") \
                    or e.key.startswith("aten::_efficient"):
                ops.append(e.key)
        kernels.sort(reverse=True)
        return sorted(set(ops)) + [k for _, k in kernels[:3]]
    except Exception as e:  # the profiler is a diagnostic only
        return ["(profiler failed: %s)" % (str(e).splitlines() or ["?"])[0][:80]]


# ---- prefill attention through SDPA ----------------------------------------------------------

def backends():
    from torch.nn.attention import SDPBackend
    return [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION)]


def sdpa_forced(backend, q, k, v, pad_v):
    """Causal SDPA with only `backend` allowed (it raises rather than fall back). q, k, v are
    [1, H, T, D]; with pad_v, v arrives padded to 192 and the output is cut back to 128."""
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel([backend]):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)
    return o[..., :VDIM] if pad_v else o


def prefill_inputs(t, h, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # [1, T, H, D] storage (the layer's token-major layout), viewed as [1, H, T, D].
    q = torch.randn(1, t, h, QK, device="cuda", dtype=BF16, generator=g).transpose(1, 2)
    k = torch.randn(1, t, h, QK, device="cuda", dtype=BF16, generator=g).transpose(1, 2)
    v = torch.randn(1, t, h, VDIM, device="cuda", dtype=BF16, generator=g).transpose(1, 2)
    return q, k, v


def try_backend(name, backend, q, k, v):
    """Runs once; returns (pad_v, note) of the first form the backend accepts, or raises."""
    try:
        sdpa_forced(backend, q, k, v, False)
        torch.cuda.synchronize()
        return False, ""
    except Exception as e:  # RuntimeError "No available kernel", NotImplementedError, ...
        first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
    vp = F.pad(v, (0, QK - VDIM))
    try:
        sdpa_forced(backend, q, k, vp, True)
        torch.cuda.synchronize()
        return True, "refused dv=128 != dqk=192 (%s); ran with v zero-padded to 192" % first
    except Exception as e2:
        raise RuntimeError("%s refused dv=128 (%s) and padded v (%s)" %
                           (name, first, str(e2).splitlines()[0][:160] if str(e2) else "?"))


def bench_prefill(timer, t, h, results, working):
    q, k, v = prefill_inputs(t, h)
    pairs = prefill_pairs(t, True)
    flops = prefill_flops(h, pairs)
    outs = {}
    for name, backend in backends():
        row = dict(name="sdpa-prefill/%s/t%d_h%d_causal" % (name, t, h), kind="prefill",
                   tokens=t, heads=h, causal=True, backend=name)
        try:
            pad_v, note = try_backend(name, backend, q, k, v)
            vv = F.pad(v, (0, QK - VDIM)) if pad_v else v  # padded before timing
            fn = lambda: sdpa_forced(backend, q, k, vv, pad_v)
            us = timer.median_us(fn)
            row.update(us=us, flops=flops, tflops=flops / (us * 1e-6) / 1e12, v_padded=pad_v,
                       kernels=cuda_kernels(fn))
            if note:
                row["note"] = note
            outs[name] = fn().float()
            working.setdefault((t, h), (name, backend, pad_v))
        except Exception as e:
            row["error"] = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        results.append(row)
    # Backends that ran must agree (a wrong forced path would show here).
    names = list(outs)
    for row in results[-len(backends()):]:
        if row.get("backend") in outs and row["backend"] != names[0]:
            row["max_abs_diff_vs_" + names[0]] = float((outs[row["backend"]] - outs[names[0]]).abs().max())
    del q, k, v, outs
    torch.cuda.empty_cache()


# ---- the whole layer composed of torch ops -----------------------------------------------

def rms_norm(x, w, eps):
    """fp32 math, one rounding back to bf16 (the semantics' RMSNorm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(BF16)


class K3Layer:
    """Random bf16 weights of the K3 layer at 12 local heads: N(0, 1/in) matrices."""

    def __init__(self, cfg, seed=7):
        g = torch.Generator(device="cuda").manual_seed(seed)
        hid, h, r = cfg["hidden"], cfg["heads"], cfg["q_lora"]
        self.cfg = cfg

        def mat(out, inp):
            return (torch.randn(out, inp, device="cuda", generator=g) / math.sqrt(inp)).to(BF16)

        def norm(n):
            return (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(BF16)

        self.w_front = mat(r + KV_LORA + ROPE, hid)  # [q_a ; kv_a_proj_with_mqa] concatenated
        self.q_norm, self.kv_norm = norm(r), norm(KV_LORA)
        self.w_qb = mat(h * QK, r)
        self.w_kvb = mat(h * (NOPE + VDIM), KV_LORA)
        self.w_g = mat(h * VDIM, hid)
        self.w_o = mat(hid, h * VDIM)
        kvb = self.w_kvb.view(h, NOPE + VDIM, KV_LORA)
        self.w_uk_t = kvb[:, :NOPE, :].contiguous()  # [H, 128, 512]
        self.w_uv = kvb[:, NOPE:, :].transpose(1, 2).contiguous()  # [H, 512, 128]

    def weight_bytes(self):
        ws = [self.w_front, self.q_norm, self.kv_norm, self.w_qb, self.w_kvb, self.w_g, self.w_o]
        return float(sum(w.numel() * w.element_size() for w in ws))

    def front(self, x):
        c = self.cfg
        f = F.linear(x, self.w_front)
        q_c, kv_c, k_pe = f.split([c["q_lora"], KV_LORA, ROPE], -1)
        q_c = rms_norm(q_c, self.q_norm, c["eps"])
        kv_c = rms_norm(kv_c, self.kv_norm, c["eps"])
        q = F.linear(q_c, self.w_qb).view(x.shape[0], c["heads"], QK)
        return q, kv_c, k_pe

    def back(self, x, o):
        o = o * torch.sigmoid(F.linear(x, self.w_g))
        return F.linear(o, self.w_o)

    def prefill(self, x, cache_flat, slots, backend, pad_v):
        """One fresh causal request of T tokens (NoPE: no rotary)."""
        t, h = x.shape[0], self.cfg["heads"]
        q, kv_c, k_pe = self.front(x)
        cache_flat.index_copy_(0, slots, torch.cat([kv_c, k_pe], -1))
        kv = F.linear(kv_c, self.w_kvb).view(t, h, NOPE + VDIM)
        k = torch.cat([kv[..., :NOPE], k_pe[:, None, :].expand(t, h, ROPE)], -1)
        v = kv[..., NOPE:].contiguous()
        if pad_v:
            v = F.pad(v, (0, QK - VDIM))
        o = sdpa_forced(backend, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                        v.transpose(0, 1)[None], pad_v)
        o = o[0].transpose(0, 1).reshape(t, h * VDIM)
        return self.back(x, o)

    def decode(self, x, cache, cache_flat, new_slots, block_tables):
        """Absorbed MQA step, one new token per request (naive: gathers the whole paged cache)."""
        b, h = x.shape[0], self.cfg["heads"]
        q, kv_c, k_pe = self.front(x)
        cache_flat.index_copy_(0, new_slots, torch.cat([kv_c, k_pe], -1))
        q_nope, q_pe = q[..., :NOPE], q[..., NOPE:]
        ql_nope = torch.bmm(q_nope.transpose(0, 1), self.w_uk_t)  # [H, B, 512]
        query = torch.cat([ql_nope.transpose(0, 1), q_pe], -1)  # [B, H, 576]
        kv = cache[block_tables].view(b, -1, LATENT)  # [B, S, 576] gathered copy
        s = torch.bmm(query, kv.transpose(1, 2)).float() * SCALE  # [B, H, S]
        p = torch.softmax(s, -1).to(BF16)
        o_lat = torch.bmm(p, kv[..., :KV_LORA])  # [B, H, 512]
        o = torch.bmm(o_lat.transpose(0, 1), self.w_uv)  # [H, B, 128]
        return self.back(x, o.transpose(0, 1).reshape(b, h * VDIM))


def random_cache(num_blocks, block_size, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = (torch.rand(num_blocks, block_size, LATENT, device="cuda", generator=g) * 2 - 1).to(BF16)
    perm = torch.randperm(num_blocks, device="cuda", generator=g)
    return cache, perm


def bench_layer_prefill(timer, t, working, results, block_size=64):
    cfg = K3
    row = dict(name="torch-layer-prefill/kimi-k3_tp8_h12/t%d" % t, kind="layer-prefill",
               tokens=t, heads=cfg["heads"], model="kimi-k3", tp=8,
               note="torch composition: cuBLAS GEMMs + SDPA")
    try:
        choice = working.get((t, 64)) or working.get((t, 16)) or next(iter(working.values()), None)
        if choice is None:
            raise RuntimeError("no SDPA backend ran the 192/128 prefill")
        name, backend, pad_v = choice
        layer = K3Layer(cfg)
        nb = (t + block_size - 1) // block_size
        cache, perm = random_cache(nb, block_size, 3)
        cache_flat = cache.view(-1, LATENT)
        pos = torch.arange(t, device="cuda")
        slots = perm[pos // block_size] * block_size + pos % block_size
        x = torch.randn(t, cfg["hidden"], device="cuda", dtype=BF16)
        fn = lambda: layer.prefill(x, cache_flat, slots, backend, pad_v)
        us = timer.median_us(fn)
        flops = (layer_projection_flops(t, cfg["hidden"], cfg["heads"], cfg["q_lora"], False) +
                 prefill_flops(cfg["heads"], prefill_pairs(t, True)))
        row.update(us=us, flops=flops, tflops=flops / (us * 1e-6) / 1e12, backend=name,
                   v_padded=pad_v)
        del layer, cache, x
    except Exception as e:
        row["error"] = (str(e).splitlines() or [type(e).__name__])[0][:300]
    results.append(row)
    torch.cuda.empty_cache()


def bench_layer_decode(timer, batch, seq, copy_gb_s, results, block_size=64):
    cfg = K3
    row = dict(name="torch-layer-decode/kimi-k3_tp8_h12/b%d_s%d_q1_bs%d_bf16" % (batch, seq, block_size),
               kind="layer-decode", batch=batch, seq=seq, q_len=1, block_size=block_size,
               cache_format="bf16", heads=cfg["heads"], model="kimi-k3", tp=8,
               backend="naive torch composition (paged-cache gather + bmm + softmax)")
    try:
        layer = K3Layer(cfg)
        blocks_each = (seq + block_size - 1) // block_size
        nb = batch * blocks_each
        cache, perm = random_cache(nb, block_size, 4)
        cache_flat = cache.view(-1, LATENT)
        block_tables = perm.view(batch, blocks_each)
        last = seq - 1  # each request's new token is its last key
        new_slots = block_tables[:, last // block_size] * block_size + last % block_size
        x = torch.randn(batch, cfg["hidden"], device="cuda", dtype=BF16)
        fn = lambda: layer.decode(x, cache, cache_flat, new_slots, block_tables)
        us = timer.median_us(fn)
        nbytes = layer.weight_bytes() + decode_bytes(batch, seq)
        flops = (layer_projection_flops(batch, cfg["hidden"], cfg["heads"], cfg["q_lora"], True) +
                 decode_flops(batch, 1, cfg["heads"], seq))
        floor_us = nbytes / (copy_gb_s * 1e9) * 1e6
        tb = nbytes / (us * 1e-6) / 1e12
        row.update(us=us, flops=flops, tflops=flops / (us * 1e-6) / 1e12, bytes=nbytes, tb_s=tb,
                   frac_copy_bw=tb * 1e3 / copy_gb_s, floor_us=floor_us, floor_ratio=us / floor_us)
        del layer, cache, x
    except Exception as e:
        row["error"] = (str(e).splitlines() or [type(e).__name__])[0][:300]
    results.append(row)
    torch.cuda.empty_cache()


# ---- report -------------------------------------------------------------------------------

def print_table(doc):
    print("torch peers: %s, %d SMs, %s; torch %s, cuDNN %s; copy bandwidth %.1f GB/s "
          "(2 GiB D2D, read+write, median of 10); median of %d runs, L2 flushed" %
          (doc["device"], doc["sm_count"], doc["date"], doc["torch_version"], doc["cudnn_version"],
           doc["copy_bandwidth_gb_s"], doc["iters"]))
    print("%-58s %10s %7s %8s  %6s  %s" % ("case", "us", "TB/s", "TFLOP/s", "copy", "note"))
    for r in doc["cases"]:
        if "error" in r:
            print("%-58s  FAILED: %s" % (r["name"], r["error"]))
            continue
        tb = "%7.3f" % r["tb_s"] if r.get("tb_s") else "      -"
        frac = "%5.1f%%" % (100 * r["frac_copy_bw"]) if r.get("frac_copy_bw") else "     -"
        notes = []
        if "floor_us" in r:
            notes.append("floor %.1f us, %.3fx floor" % (r["floor_us"], r["floor_ratio"]))
        if r.get("v_padded"):
            notes.append("v padded to 192")
        if r.get("kernels"):
            notes.append("ran " + ", ".join(k[:60] for k in r["kernels"][:2]))
        if "note" in r and not r.get("v_padded"):
            notes.append(r["note"])
        print("%-58s %10.1f %s %8.1f  %s  %s" % (r["name"], r["us"], tb, r["tflops"], frac,
                                                 "; ".join(notes)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results to this JSON file")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default="", help="run only cases whose name contains this")
    ap.add_argument("--write-flush", action="store_true",
                    help="flush L2 by filling a buffer (leaves dirty lines) instead of reading it")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_peers.py needs a CUDA GPU")

    props = torch.cuda.get_device_properties(0)
    timer = Timer(args.warmup, args.iters, args.write_flush)
    copy_gb_s = copy_bandwidth_gb_s(timer)
    results, working = [], {}

    def wanted(name):
        return args.only in name

    for t, h in [(8192, 64), (8192, 16), (32768, 16)]:
        if any(wanted("sdpa-prefill/%s/t%d_h%d_causal" % (n, t, h)) for n, _ in backends()):
            bench_prefill(timer, t, h, results, working)
    if wanted("torch-layer-prefill/kimi-k3_tp8_h12/t8192"):
        if (8192, 64) not in working and (8192, 16) not in working:
            bench_prefill(timer, 8192, 16, [], working)  # find a backend that runs 192/128
        bench_layer_prefill(timer, 8192, working, results)
    if wanted("torch-layer-decode/kimi-k3_tp8_h12/b128_s8192_q1_bs64_bf16"):
        bench_layer_decode(timer, 128, 8192, copy_gb_s, results)

    doc = dict(
        device=torch.cuda.get_device_name(0), sm_count=props.multi_processor_count,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        torch_version=torch.__version__, cuda_version=torch.version.cuda,
        cudnn_version=str(torch.backends.cudnn.version()), copy_bandwidth_gb_s=copy_gb_s,
        iters=args.iters, warmup=args.warmup, cases=results)
    for r in results:
        if r.get("us") and r.get("bytes") and "frac_copy_bw" not in r:
            r["tb_s"] = r["bytes"] / (r["us"] * 1e-6) / 1e12
            r["frac_copy_bw"] = r["tb_s"] * 1e3 / copy_gb_s
    print_table(doc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    # Other backends refusing 192/128 is information; the cuDNN peer and the layers must run.
    needed = [r for r in results if r.get("backend") == "cudnn" or r["kind"].startswith("layer")]
    return 0 if all("error" not in r for r in needed) else 1


if __name__ == "__main__":
    sys.exit(main())
