"""kmla from NumPy: configs, caches, batch metadata, the layer against the fp64 oracle, stages
and error messages. Always runs (NumPy only)."""
import zlib

import numpy as np
import pytest

import kmla
from kmla.testing import check_against_oracle, mixed_batch, round_to

PRESETS = kmla.preset_names()
FORMATS = ["bf16", "fp16", "fp8", "fp8_ds_mla"]


# ---- config ------------------------------------------------------------------------------
def test_presets():
    assert set(PRESETS) >= {"kimi-k3", "kimi-k3-dspark", "kimi-linear-48b", "kimi-k2", "deepseek-v3"}
    k3 = kmla.MlaConfig.preset("kimi-k3")
    assert (k3.num_heads, k3.hidden_size, k3.use_output_gate, k3.use_rope) == (96, 7168, True, False)
    assert k3.softmax_scale == pytest.approx(192 ** -0.5)
    assert kmla.MlaConfig.preset("deepseek-v3").softmax_scale == pytest.approx(0.135234, rel=1e-5)
    assert k3.tp_slice(0, 8).local_heads == 12
    assert kmla.MlaConfig.preset("kimi-linear-48b").q_lora_rank is None
    with pytest.raises(kmla.Error, match="num_heads 96 is not divisible"):
        k3.tp_slice(0, 5)
    with pytest.raises(kmla.Error, match="no-such-model"):
        kmla.MlaConfig.preset("no-such-model")


def test_config_fields_are_writable():
    c = kmla.MlaConfig.small("kimi-k3", heads=3)
    assert (c.hidden_size, c.q_lora_rank, c.num_heads) == (256, 96, 3)
    c.num_heads = 4
    c.q_lora_rank = None
    assert (c.num_heads, c.q_lora_rank) == (4, None)
    c.validate()
    c.rope.theta = 50000.0
    assert c.rope.theta == 50000.0


def test_from_hf(checkpoints):
    k3 = kmla.MlaConfig.from_hf(str(checkpoints / "k3_tiny" / "config.json"))
    assert (k3.num_heads, k3.hidden_size, k3.q_lora_rank, k3.use_output_gate, k3.use_rope) == (4, 256, 96, True, False)
    kl = kmla.MlaConfig.from_hf(str(checkpoints / "kimi_linear_tiny"))  # a directory works too
    assert (kl.num_heads, kl.hidden_size, kl.q_lora_rank, kl.use_output_gate) == (3, 192, None, False)
    ds = kmla.MlaConfig.from_hf(str(checkpoints / "dsv3_fp8_tiny"))
    assert ds.use_rope and ds.rope.type == "deepseek_yarn" and ds.rope.factor == 40
    assert ds.softmax_scale == pytest.approx(0.135234, rel=1e-5)
    hf = kmla.load_hf_config(str(checkpoints / "k3_tiny"))
    assert (hf.model_type, hf.num_hidden_layers, hf.mla_layers) == ("kimi_k3", 4, [1, 3])
    assert kmla.load_hf_config(str(checkpoints / "dsv3_fp8_tiny")).quant_method == "fp8"
    with pytest.raises(kmla.Error, match="nope.json"):
        kmla.MlaConfig.from_hf(str(checkpoints / "nope.json"))


# ---- cache -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,entry", [("bf16", 1152), ("fp16", 1152), ("fp8", 576), ("fp8_ds_mla", 656)])
def test_cache_allocate(fmt, entry):
    c = kmla.LatentCache(fmt, block_size=16, num_blocks=5)
    assert (c.format, c.block_size, c.num_blocks, c.entry_bytes, c.device) == (fmt, 16, 5, entry, "cpu")
    assert kmla.cache_entry_bytes(fmt) == entry
    b = c.bytes()
    assert b.dtype == np.uint8 and b.shape == (5, c.block_stride) and c.block_stride >= 16 * entry
    assert not b.any()  # zero-filled
    # bytes() is a view: writing a row shows up in it.
    row = round_to(np.linspace(-2, 2, 576, dtype=np.float32))
    c.write_row(37, row)
    assert b.any()
    got = c.read_row(37)
    if fmt in ("bf16", "fp16"):
        np.testing.assert_array_equal(got, row if fmt == "bf16" else row.astype(np.float16).astype(np.float32))
    else:  # fp8: within one e4m3 step (2^-3 relative) of the row's largest value
        np.testing.assert_allclose(got, row, atol=2.0 * 2 ** -3)


def test_cache_borrow_numpy_is_zero_copy():
    mem = np.zeros((4, 16 * 1152), dtype=np.uint8)
    c = kmla.LatentCache.borrow(mem, "bf16", 16)
    assert c.data_ptr == mem.ctypes.data and c.num_blocks == 4 and c.block_stride == 16 * 1152
    c.write_row(17, np.ones(576, dtype=np.float32))
    # slot 17 = block 1, row 1; bf16(1.0) = 0x3F80, little-endian.
    assert mem[1, 1152 : 1152 + 2].tolist() == [0x80, 0x3F]
    with pytest.raises(kmla.Error, match="not C-contiguous"):
        kmla.LatentCache.borrow(np.zeros((16 * 1152, 4), dtype=np.uint8).T, "bf16", 16)


def e4m3_decode(codes):
    """e4m3fn codes -> float32, written out (no fp8 dtype in NumPy or torch 1.13)."""
    c = codes.astype(np.int32)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exp, man = (c >> 3) & 0xF, c & 0x7
    val = np.where(exp == 0, man * 2.0 ** -9, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = np.where((exp == 0xF) & (man == 0x7), np.nan, val)
    return (sign * val).astype(np.float32)


def bf16_decode(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla"])
def test_fp8_cache_bytes_decode_by_hand(fmt):
    rng = np.random.default_rng(3)
    c = kmla.LatentCache(fmt, block_size=4, num_blocks=2, k_scale=0.5)
    row = round_to(rng.standard_normal(576).astype(np.float32) * 3)
    c.write_row(5, row)
    raw = c.bytes()[1, c.entry_bytes : 2 * c.entry_bytes]
    if fmt == "fp8":
        mine = e4m3_decode(raw) * np.float32(0.5)
    else:
        scales = raw[512:528].view(np.float32)
        kv = e4m3_decode(raw[:512]) * np.repeat(scales, 128)
        mine = np.concatenate([round_to(kv), bf16_decode(raw[528:656].view(np.uint16))])
        np.testing.assert_array_equal(mine[512:], row[512:])  # rope part stored as bf16
    np.testing.assert_array_equal(mine, c.read_row(5))
    np.testing.assert_allclose(mine, row, rtol=2 ** -3, atol=np.abs(row).max() * 2 ** -3)


# ---- batch metadata ----------------------------------------------------------------------
def test_plan_batch_layout():
    cache = kmla.LatentCache("bf16", block_size=4, num_blocks=16)
    # caller order: a fresh prefill, a decode, a prefill with context
    md = kmla.plan_batch([3, 1, 2], [0, 5, 4], [[7], [2, 9, 11], [3, 4]], cache)
    assert (md.num_requests, md.num_decodes, md.num_context_prefills, md.num_fresh_prefills) == (3, 1, 1, 1)
    assert (md.num_tokens, md.num_rows, md.num_decode_tokens) == (6, 6, 1)
    assert md.request_order.tolist() == [1, 2, 0]
    assert md.query_lens.tolist() == [1, 2, 3] and md.context_lens.tolist() == [5, 4, 0]
    assert md.positions.tolist() == [5, 4, 5, 0, 1, 2]
    # decode token at position 5 -> block 9 (table [2, 9, 11]), row 1
    assert md.slot_mapping.tolist() == [9 * 4 + 1, 4 * 4 + 0, 4 * 4 + 1, 7 * 4, 7 * 4 + 1, 7 * 4 + 2]
    assert [md.kind(r) for r in range(3)] == ["decode", "context_prefill", "fresh_prefill"]
    assert md.row_order.tolist() == [3, 4, 5, 0, 1, 2]
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    np.testing.assert_array_equal(md.from_layout(md.to_layout(x)), x)
    padded = kmla.plan_batch([1], [3], [[0]], cache, num_rows=4)
    assert padded.num_rows == 4 and padded.slot_mapping.tolist() == [3, -1, -1, -1]
    md.validate(cache)


def test_plan_batch_errors():
    cache = kmla.LatentCache("bf16", block_size=4, num_blocks=4)
    with pytest.raises(kmla.Error, match="block"):
        kmla.plan_batch([1], [8], [[0, 1]], cache)  # 9 tokens need 3 blocks
    with pytest.raises(kmla.Error, match="block"):
        kmla.plan_batch([1], [0], [[9]], cache)  # block id outside the cache
    with pytest.raises(kmla.Error, match="query_lens"):
        kmla.plan_batch([1, 2], [0], [[0]], cache)


# ---- the layer vs the oracle ---------------------------------------------------------------
def make_layer(preset, fmt, heads=2, device="cpu", seed=5):
    cfg = kmla.MlaConfig.small(preset, heads=heads)
    act = "f16" if fmt == "fp16" else "bf16"  # the fp16 cache is the "auto" cache of an fp16 model
    w = kmla.MlaWeights.random(cfg, seed, act)
    if fmt == "fp8":  # non-unit scales, so a missing descale cannot hide
        w.k_scale, w.q_scale = 0.5, 0.25
    return kmla.MlaLayer(cfg, w, activation=act, device=device, rope_rows=4096)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("preset", PRESETS)
def test_forward_matches_oracle(preset, fmt):
    layer = make_layer(preset, fmt)
    case = mixed_batch(layer, fmt, block_size=16, seed=zlib.crc32(f"{preset}/{fmt}".encode()) % 1000)
    before = case.cache.to_host()
    out = layer.forward(case.positions, case.hidden, case.metadata, case.cache)
    assert out.dtype == np.float32 and out.shape == case.hidden.shape
    r = check_against_oracle(layer, case.positions, case.hidden, case.metadata, before, out)
    assert r["pass"], r
    # forward wrote the new tokens' rows where the oracle writes them
    after_ref = before.to_host()
    layer.oracle(case.positions, case.hidden, case.metadata, after_ref)
    for slot in case.metadata.slot_mapping[: case.metadata.num_tokens][:8]:
        ref = after_ref.read_row(int(slot))
        np.testing.assert_allclose(case.cache.read_row(int(slot)), ref, atol=np.abs(ref).max() * 2 ** -3)


def test_forward_into_given_out_and_reproducible():
    layer = make_layer("kimi-k3", "bf16")
    case = mixed_batch(layer, "bf16")
    c2 = case.cache.to_host()
    out = np.full(case.hidden.shape, np.nan, dtype=np.float32)
    got = layer.forward(case.positions, case.hidden, case.metadata, case.cache, out=out)
    assert got is None or got is out or np.shares_memory(got, out)
    np.testing.assert_array_equal(out, layer.forward(case.positions, case.hidden, case.metadata, c2))


def test_checkpoint_layer(checkpoints):
    layer = kmla.MlaLayer.from_checkpoint(str(checkpoints / "k3_tiny"), 3)
    assert layer.config.num_heads == 4 and layer.weights.dtype == "bf16"
    arrays = layer.weights.arrays()
    assert arrays["kv_b_proj"].shape == (4 * 256, 512) and "q_proj" not in arrays
    case = mixed_batch(layer, "fp8_ds_mla", block_size=16)
    before = case.cache.to_host()
    out = layer(case.positions, case.hidden, case.metadata, case.cache)
    assert check_against_oracle(layer, case.positions, case.hidden, case.metadata, before, out)["pass"]
    # The same layer from arrays gives the same output, bit for bit.
    again = kmla.MlaLayer.from_arrays(layer.config, arrays)
    np.testing.assert_array_equal(again.forward(case.positions, case.hidden, case.metadata, before.to_host()), out)
    tp = kmla.MlaLayer.from_checkpoint(str(checkpoints / "k3_tiny"), 3, tp_rank=1, tp_size=2)
    assert tp.config.local_heads == 2


# ---- errors --------------------------------------------------------------------------------
def test_errors_name_the_argument():
    layer = make_layer("kimi-k3", "bf16")
    case = mixed_batch(layer, "bf16")
    p, h, md, c = case.positions, case.hidden, case.metadata, case.cache
    with pytest.raises(kmla.Error, match="hidden_states: dtype f64, expected bf16"):
        layer.forward(p, h.astype(np.float64), md, c)
    with pytest.raises(kmla.Error, match="positions: dtype i32, expected i64"):
        layer.forward(p.astype(np.int32), h, md, c)
    with pytest.raises(kmla.Error, match="not C-contiguous"):
        layer.forward(p, np.asfortranarray(h), md, c)
    with pytest.raises(kmla.Error, match="hidden_states"):
        layer.forward(p, h[:, :128].copy(), md, c)  # wrong hidden size
    with pytest.raises(kmla.Error, match="rows"):
        layer.forward(p[:-1], h[:-1], md, c)  # metadata rows differ
    with pytest.raises(kmla.Error, match="out: .*read-only"):
        ro = np.zeros_like(h)
        ro.setflags(write=False)
        layer.forward(p, h, md, c, out=ro)
    assert issubclass(kmla.Error, RuntimeError)
    if not kmla.built_with_cuda or not kmla.cuda_available():
        with pytest.raises(kmla.Error, match="cuda"):
            kmla.MlaLayer(layer.config, layer.weights, device="cuda")


# ---- stages --------------------------------------------------------------------------------
def test_cache_insert_and_merge():
    rng = np.random.default_rng(1)
    cache = kmla.LatentCache("bf16", block_size=4, num_blocks=3)
    kv = round_to(rng.standard_normal((3, 512)))
    kpe = round_to(rng.standard_normal((3, 64)))
    kmla.cache_insert(kv, kpe, np.array([0, 1, 2]), np.array([5, -1, 0]), cache)
    np.testing.assert_array_equal(cache.read_row(5), np.concatenate([kv[0], kpe[0]]))
    np.testing.assert_array_equal(cache.read_row(0), np.concatenate([kv[2], kpe[2]]))
    assert not cache.bytes()[0, 1152 : 2 * 1152].any()  # slot 1 untouched (slot -1 skipped)
    with pytest.raises(kmla.Error, match="slot"):
        kmla.cache_insert(kv, kpe, np.array([0, 1, 2]), np.array([5, 99, 0]), cache)

    po, so = round_to(rng.standard_normal((4, 2, 128))), round_to(rng.standard_normal((4, 2, 128)))
    pl, sl = rng.standard_normal((4, 2)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32)
    out, lse = kmla.merge_attn_states(po, pl, so, sl, 3)
    m = np.maximum(pl, sl)
    wp, ws = np.exp(pl - m), np.exp(sl - m)
    ref = (po * wp[..., None] + so * ws[..., None]) / (wp + ws)[..., None]
    np.testing.assert_allclose(out[:3], ref[:3], atol=2 ** -7 * np.abs(ref).max())
    np.testing.assert_allclose(lse[:3], (m + np.log(wp + ws))[:3], rtol=1e-5)
    np.testing.assert_array_equal(out[3], so[3])  # rows past rows_with_prefix take the suffix


def test_decode_and_prefill_attention_shapes():
    layer = make_layer("kimi-k3", "bf16")
    case = mixed_batch(layer, "bf16")
    md, h = case.metadata, layer.config.local_heads
    td = md.num_decode_tokens
    q = round_to(np.random.default_rng(2).standard_normal((td, h, 576)) * 0.1)
    # decode keys must be in the cache: write this step's rows first via the layer
    layer.forward(case.positions, case.hidden, md, case.cache)
    out, lse = kmla.decode_attention(q, case.cache, md, layer.config.softmax_scale)
    assert out.shape == (td, h, 512) and lse.shape == (td, h) and np.isfinite(out).all()
    qp = round_to(np.random.default_rng(3).standard_normal((5, h, 192)))
    v = round_to(np.random.default_rng(4).standard_normal((5, h, 128)))
    o, l = kmla.prefill_attention(qp, qp, v, [0, 5], [0, 5], True, 0.1)
    np.testing.assert_allclose(o[0], v[0], atol=2 ** -7 * np.abs(v[0]).max())  # first query sees one key
    assert o.shape == (5, h, 128) and l.shape == (5, h)
