"""Test helpers: the standard mixed batch (the C++ verify cases' shape) and the oracle check.

    case = mixed_batch(layer, "fp8_ds_mla", block_size=16)
    before = case.cache.to_host()
    out = layer.forward(case.positions, case.hidden, case.metadata, case.cache)
    report = check_against_oracle(layer, case.positions, case.hidden, case.metadata, before, out)
"""

from dataclasses import dataclass

import numpy as np

from . import LatentCache, MlaLayer, plan_batch


def round_to(x, activation="bf16"):
    """float32 values rounded to bf16 (or f16) and widened back, round to nearest even."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if activation == "f16":
        return x.astype(np.float16).astype(np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    nan = np.isnan(x)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    r = u.astype(np.uint32).view(np.float32)
    return np.where(nan, np.float32(np.nan), r)


@dataclass
class MixedBatch:
    requests: list          # (query_len, context_len) in the caller's order
    block_tables: list
    cache: LatentCache      # poisoned with 0xFF (NaN in every format), context rows written
    metadata: object
    positions: np.ndarray   # int64 [rows], layout order
    hidden: np.ndarray      # float32 [rows, hidden], layout order, values exact in bf16/f16


def mixed_batch(layer_or_config, cache_format="bf16", block_size=16, seed=1, *, activation=None,
                requests=None, padding_rows=2, decode_threshold=3, k_scale=None) -> MixedBatch:
    """Single-token decodes, a multi-token decode block, prefills whose context spans several
    workspace chunks and ends just off a block boundary, a fresh prefill and padding rows,
    with permuted block tables (as src/verify/cases.cpp builds them)."""
    cfg = layer_or_config.config if isinstance(layer_or_config, MlaLayer) else layer_or_config
    if activation is None:
        activation = layer_or_config.activation if isinstance(layer_or_config, MlaLayer) else "bf16"
    rng = np.random.default_rng(seed)
    b = block_size
    ctx_a, ctx_b = max(2 * b + 1, 37), max(b - 1, 21)
    if requests is None:
        requests = [(9, 0), (1, ctx_b), (5, ctx_a), (3, b + 1), (1, 2 * b - 1), (7, ctx_b + 2),
                    (2, 1)]
    need = [-(-(q + c) // b) for q, c in requests]
    blocks = sum(need) + 3
    ids = rng.permutation(blocks).astype(np.int32)
    tables, nxt = [], 0
    for n in need:
        tables.append(ids[nxt:nxt + n].tolist() + [-7])  # junk past the needed entries
        nxt += n
    if k_scale is None:  # the layer's (the CPU layer insists they match for fp8)
        k_scale = layer_or_config.weights.k_scale if isinstance(layer_or_config, MlaLayer) else 1.0
    cache = LatentCache(cache_format, b, blocks, k_scale=k_scale)
    cache.fill(0xFF)
    for (q, c), table in zip(requests, tables):
        for p in range(c):
            row = round_to(rng.standard_normal(576), activation)
            cache.write_row(table[p // b] * b + p % b, row)
    tokens = sum(q for q, _ in requests)
    md = plan_batch([q for q, _ in requests], [c for _, c in requests], tables, cache,
                    decode_threshold=decode_threshold,
                    non_causal_decode=cfg.non_causal_multi_token_decode,
                    num_rows=tokens + padding_rows, workspace_tokens=max(2 * b, 24))
    caller = round_to(rng.standard_normal((tokens, cfg.hidden_size)), activation)
    hidden = md.to_layout(caller)
    junk = rng.standard_normal((padding_rows, cfg.hidden_size))
    hidden[tokens:] = round_to(junk, activation)  # padding rows: junk the layer must ignore
    return MixedBatch(list(requests), tables, cache, md, md.positions.copy(), hidden)


def check_against_oracle(layer, positions, hidden, metadata, cache_before, out):
    """The verify tolerance rule: |out - exact oracle| <= 2 * |seed-rounding oracle - exact|
    + one activation ulp of the largest output; padding rows exactly zero; finite where the
    oracle is finite. `cache_before`: a host copy of the cache taken before forward."""
    exact = layer.oracle(positions, hidden, metadata, cache_before.to_host(), rounding="exact")
    seed = layer.oracle(positions, hidden, metadata, cache_before.to_host(), rounding="seed")
    if hasattr(out, "float") and not isinstance(out, np.ndarray):  # a torch tensor
        out = out.float().cpu().numpy()
    got = out
    got = np.asarray(got, dtype=np.float64)
    n = metadata.num_tokens
    finite_ref = np.isfinite(exact[:n])
    nonfinite_mismatch = bool(np.any(finite_ref != np.isfinite(got[:n])))
    ok = finite_ref & np.isfinite(got[:n])
    max_ref = float(np.max(np.abs(exact[:n][ok]), initial=0.0))
    err = float(np.max(np.abs(got[:n][ok] - exact[:n][ok]), initial=0.0))
    base = float(np.max(np.abs(seed[:n][ok] - exact[:n][ok]), initial=0.0))
    ulp = 2.0 ** -8 if layer.activation == "bf16" else 2.0 ** -11
    bound = 2.0 * base + ulp * max_ref
    padding_zero = bool(np.all(got[n:] == 0))
    return {
        "max_ref": max_ref, "err": err, "baseline": base, "bound": bound,
        "padding_zero": padding_zero, "nonfinite_mismatch": nonfinite_mismatch,
        "pass": err <= bound and padding_zero and not nonfinite_mismatch and max_ref > 0,
    }
