"""kmla with torch tensors on the CPU (DLPack, bf16 in and out, zero copy). Skipped without torch
(Debian's python3-torch 1.13 is enough)."""
import numpy as np
import pytest

import kmla
from kmla.testing import check_against_oracle, mixed_batch

torch = pytest.importorskip("torch")

PRESETS = kmla.preset_names()
FORMATS = ["bf16", "fp16", "fp8", "fp8_ds_mla"]


def make_layer(preset, fmt, heads=2, seed=5):
    cfg = kmla.MlaConfig.small(preset, heads=heads)
    act = "f16" if fmt == "fp16" else "bf16"
    w = kmla.MlaWeights.random(cfg, seed, act)
    if fmt == "fp8":
        w.k_scale, w.q_scale = 0.5, 0.25
    return kmla.MlaLayer(cfg, w, activation=act, rope_rows=4096)


def torch_cache(case):
    """The case's cache bytes in a torch uint8 tensor, borrowed (zero copy)."""
    t = torch.from_numpy(case.cache.bytes().copy())
    c = case.cache
    return t, kmla.LatentCache.borrow(t, c.format, c.block_size, c.k_scale, c.tile_rule)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("preset", PRESETS)
def test_torch_forward_equals_numpy_forward(preset, fmt):
    layer = make_layer(preset, fmt)
    tdt = torch.float16 if fmt == "fp16" else torch.bfloat16
    case = mixed_batch(layer, fmt, block_size=16, seed=7)
    before = case.cache.to_host()
    t, tcache = torch_cache(case)
    assert tcache.data_ptr == t.data_ptr()
    hidden = torch.from_numpy(case.hidden).to(tdt)  # exact: the values are tdt-representable
    out = layer.forward(torch.from_numpy(case.positions), hidden, case.metadata, tcache)
    assert out.dtype == tdt and out.shape == hidden.shape
    ref = layer.forward(case.positions, case.hidden, case.metadata, case.cache)
    np.testing.assert_array_equal(out.float().numpy(), ref)  # same bf16 inputs, same engine
    # the torch-owned cache got exactly the bytes the kmla-owned one got
    np.testing.assert_array_equal(t.numpy(), case.cache.bytes())
    assert check_against_oracle(layer, case.positions, hidden, case.metadata, before, out)["pass"]


def test_zero_copy_out_and_dlpack_objects():
    layer = make_layer("kimi-k3", "bf16")
    case = mixed_batch(layer, "bf16")
    hidden = torch.from_numpy(case.hidden).bfloat16()
    out = torch.full_like(hidden, float("nan"))
    got = layer.forward(torch.from_numpy(case.positions), hidden, case.metadata, case.cache, out=out)
    assert got is out and got.data_ptr() == out.data_ptr() and torch.isfinite(out).all()
    # The bindings read any __dlpack__ producer directly, and capsules too.
    t = torch.zeros(4, 16 * 656, dtype=torch.uint8)
    assert kmla._kmla.Cache.borrow(t, "fp8_ds_mla", 16).data_ptr == t.data_ptr()
    assert kmla._kmla.Cache.borrow(torch.utils.dlpack.to_dlpack(t), "fp8_ds_mla", 16).data_ptr == t.data_ptr()
    # Weights from torch tensors (copied once into the layer).
    arrays = {k: torch.from_numpy(v).bfloat16() for k, v in layer.weights.arrays().items()}
    again = kmla.MlaLayer.from_arrays(layer.config, arrays)
    case2 = mixed_batch(layer, "bf16")
    np.testing.assert_array_equal(
        again.forward(case2.positions, case2.hidden, case2.metadata, case2.cache.to_host()),
        layer.forward(case2.positions, case2.hidden, case2.metadata, case2.cache))


def test_torch_errors():
    layer = make_layer("kimi-k3", "bf16")
    case = mixed_batch(layer, "bf16")
    p, md, c = torch.from_numpy(case.positions), case.metadata, case.cache
    h = torch.from_numpy(case.hidden).bfloat16()
    with pytest.raises(kmla.Error, match="hidden_states: dtype f32, expected bf16"):
        layer.forward(p, h.float(), md, c)
    with pytest.raises(kmla.Error, match="hidden_states: dtype f16"):
        layer.forward(p, h.half(), md, c)
    with pytest.raises(kmla.Error, match="not contiguous"):
        layer.forward(p, h.t().contiguous().t(), md, c)
    with pytest.raises(kmla.Error, match="positions: dtype i32"):
        layer.forward(p.int(), h, md, c)
    with pytest.raises(kmla.Error, match=r"out has shape \[30, 8\], expected \[30, 256\]"):
        layer.forward(p, h, md, c, out=torch.empty(h.shape[0], 8, dtype=torch.bfloat16))
    with pytest.raises(kmla.Error, match="out: required"):
        layer._impl.forward(kmla._dl(p), kmla._dl(h), md, c._impl, None, 0)


def test_torch_stages():
    rng = np.random.default_rng(1)
    po = torch.randn(4, 2, 128).bfloat16()
    so = torch.randn(4, 2, 128).bfloat16()
    pl, sl = torch.randn(4, 2), torch.randn(4, 2)
    out, lse = kmla.merge_attn_states(po, pl, so, sl, 4)
    ref_out, ref_lse = kmla.merge_attn_states(po.float().numpy(), pl.numpy(), so.float().numpy(), sl.numpy(), 4)
    np.testing.assert_array_equal(out.float().numpy(), ref_out)
    np.testing.assert_array_equal(lse.numpy(), ref_lse)
    t = torch.zeros(2, 4 * 1152, dtype=torch.uint8)
    cache = kmla.LatentCache.borrow(t, "bf16", 4)
    kv, kpe = torch.randn(2, 512).bfloat16(), torch.randn(2, 64).bfloat16()
    kmla.cache_insert(kv, kpe, torch.tensor([0, 1]), torch.tensor([6, 1]), cache)
    np.testing.assert_array_equal(cache.read_row(6), torch.cat([kv[0], kpe[0]]).float().numpy())
    assert t[1, 2 * 1152: 3 * 1152].any() and not t[0, 2 * 1152:].any()
    del rng
