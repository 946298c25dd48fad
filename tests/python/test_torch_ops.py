"""The torch.library custom ops on the CPU: eager, torch.compile (fullgraph) and opcheck.
Skipped with a reason where torch has no torch.library.custom_op (Debian's torch 1.13)."""
import numpy as np
import pytest

import kmla
from kmla.testing import mixed_batch

torch = pytest.importorskip("torch")
if not kmla.torch_ops.available:
    pytest.skip(kmla.torch_ops.reason, allow_module_level=True)


def setup(fmt="bf16", preset="kimi-k3-dspark-yarn"):
    cfg = kmla.MlaConfig.small(preset, heads=2)
    layer = kmla.MlaLayer.random(cfg, 3, rope_rows=4096)
    case = mixed_batch(layer, fmt, block_size=16)
    return layer, case


def fresh(case):
    t = torch.from_numpy(case.cache.bytes().copy())
    c = case.cache
    return t, kmla.LatentCache.borrow(t, c.format, c.block_size, c.k_scale, c.tile_rule)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_mla_forward_op_eager_and_compiled(fmt):
    layer, case = setup(fmt)
    pos = torch.from_numpy(case.positions)
    hid = torch.from_numpy(case.hidden).bfloat16()
    t_ref, c_ref = fresh(case)
    ref = layer.forward(pos, hid, case.metadata, c_ref)
    t_op, c_op = fresh(case)
    step = layer.prepare(case.metadata, c_op)
    out = torch.ops.kmla.mla_forward(pos, hid, t_op, step.workspace, layer.handle, step.handle)
    assert torch.equal(out, ref) and torch.equal(t_op, t_ref)

    def f(pos, hid, cache, ws):
        return torch.ops.kmla.mla_forward(pos, hid, cache, ws, layer.handle, step.handle) * 2

    t_c, _ = fresh(case)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(pos, hid, t_c, step.workspace)
    assert torch.equal(got, ref * 2)
    assert torch.equal(t_c, t_ref)  # the cache mutation survives functionalization


def test_cache_insert_and_merge_ops():
    layer, _ = setup()
    t = torch.zeros(3, 4 * 1152, dtype=torch.uint8)
    kv, kpe = torch.randn(2, 512).bfloat16(), torch.randn(2, 64).bfloat16()
    pos, slots = torch.tensor([3, 7]), torch.tensor([5, 0])
    torch.ops.kmla.cache_insert(kv, kpe, pos, slots, t, "bf16", 4, 1.0, "power_of_two", layer.handle)
    ref = kmla.LatentCache("bf16", 4, 3)
    kmla.cache_insert(kv, kpe, pos, slots, ref, layer)
    assert np.array_equal(t.numpy(), ref.bytes()) and t.any()

    po, so = torch.randn(5, 2, 128).bfloat16(), torch.randn(5, 2, 128).bfloat16()
    pl, sl = torch.randn(5, 2), torch.randn(5, 2)
    out, lse = torch.ops.kmla.merge_attn_states(po, pl, so, sl, 3)
    ref_out, ref_lse = kmla.merge_attn_states(po, pl, so, sl, 3)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    torch.library.opcheck(torch.ops.kmla.merge_attn_states.default, (po, pl, so, sl, 3))
    compiled = torch.compile(lambda *a: torch.ops.kmla.merge_attn_states(*a, 3), fullgraph=True,
                             backend="aot_eager")
    c_out, c_lse = compiled(po, pl, so, sl)
    assert torch.equal(c_out, out) and torch.equal(c_lse, lse)
