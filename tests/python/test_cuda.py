"""kmla on CUDA tensors: the CUDA layer against the CPU layer and the oracle, the custom ops
under torch.compile, and CUDA graph capture. Skipped unless torch sees a GPU and kmla was
built with its CUDA backend."""
import numpy as np
import pytest

import kmla
from kmla.testing import check_against_oracle, mixed_batch

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no GPU visible to torch", allow_module_level=True)
if not (kmla.built_with_cuda and kmla.cuda_available()):
    pytest.skip("kmla was built without its CUDA backend (or sees no GPU)", allow_module_level=True)

PRESETS = kmla.preset_names()
FORMATS = ["bf16", "fp16", "fp8", "fp8_ds_mla"]


def make_layers(preset, fmt, heads=3, seed=9):
    cfg = kmla.MlaConfig.small(preset, heads=heads)
    act = "f16" if fmt == "fp16" else "bf16"
    w = kmla.MlaWeights.random(cfg, seed, act)
    if fmt == "fp8":
        w.k_scale, w.q_scale = 0.5, 0.25
    cpu = kmla.MlaLayer(cfg, w, activation=act, rope_rows=4096)
    gpu = kmla.MlaLayer(cfg, w, activation=act, rope_rows=4096, device="cuda")
    return cpu, gpu


def device_cache(case):
    t = torch.from_numpy(case.cache.bytes().copy()).cuda()
    c = case.cache
    return t, kmla.LatentCache.borrow(t, c.format, c.block_size, c.k_scale, c.tile_rule)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("preset", PRESETS)
def test_cuda_forward_matches_cpu_and_oracle(preset, fmt):
    cpu, gpu = make_layers(preset, fmt)
    tdt = torch.float16 if fmt == "fp16" else torch.bfloat16
    case = mixed_batch(cpu, fmt, block_size=16, seed=11)
    before = case.cache.to_host()
    t, dcache = device_cache(case)
    assert dcache.device == "cuda" and dcache.data_ptr == t.data_ptr()
    hid = torch.from_numpy(case.hidden).to(tdt).cuda()
    pos = torch.from_numpy(case.positions).cuda()
    out = gpu.forward(pos, hid, case.metadata, dcache)
    gpu.check_errors()
    assert out.is_cuda and out.dtype == tdt
    r = check_against_oracle(cpu, case.positions, case.hidden, case.metadata, before, out)
    assert r["pass"], r
    # CPU backend on the same inputs: within the same bound of each other's oracle distance
    ref = cpu.forward(case.positions, case.hidden, case.metadata, case.cache)
    assert np.abs(out.float().cpu().numpy() - ref).max() <= 2 * r["bound"]
    # new cache rows: decoded, within one storage step of the CPU's
    host = kmla.LatentCache.borrow(t.cpu(), case.cache.format, 16, case.cache.k_scale)
    for slot in case.metadata.slot_mapping[: case.metadata.num_tokens]:
        a, b = host.read_row(int(slot)), case.cache.read_row(int(slot))
        np.testing.assert_allclose(a, b, atol=np.abs(b).max() * 2 ** -3)


def test_kmla_owned_device_cache():
    cpu, gpu = make_layers("kimi-k3", "bf16")
    case = mixed_batch(cpu, "bf16")
    dc = kmla.LatentCache("bf16", 16, case.cache.num_blocks, device="cuda")
    dc.copy_from(case.cache)
    np.testing.assert_array_equal(dc.bytes(), case.cache.bytes())
    out = gpu.forward(torch.from_numpy(case.positions).cuda(), torch.from_numpy(case.hidden).bfloat16().cuda(),
                      case.metadata, dc)
    ref = cpu.forward(case.positions, case.hidden, case.metadata, case.cache)
    assert np.abs(out.float().cpu().numpy() - ref).max() <= 2 ** -4 * np.abs(ref).max()
    with pytest.raises(kmla.Error, match="cache is in cpu memory"):
        gpu.forward(torch.from_numpy(case.positions).cuda(), torch.from_numpy(case.hidden).bfloat16().cuda(),
                    case.metadata, case.cache)
    with pytest.raises(kmla.Error, match="tensor is on cpu"):
        gpu.forward(torch.from_numpy(case.positions), torch.from_numpy(case.hidden).bfloat16().cuda(),
                    case.metadata, dc)


def test_ops_on_cuda_under_compile():
    cpu, gpu = make_layers("kimi-k3-dspark-yarn", "fp8_ds_mla")
    case = mixed_batch(cpu, "fp8_ds_mla")
    pos = torch.from_numpy(case.positions).cuda()
    hid = torch.from_numpy(case.hidden).bfloat16().cuda()
    t_ref, c_ref = device_cache(case)
    ref = gpu.forward(pos, hid, case.metadata, c_ref)
    if not kmla.torch_ops.available:
        pytest.skip(kmla.torch_ops.reason)
    t, c = device_cache(case)
    step = gpu.prepare(case.metadata, c)

    def f(pos, hid, cache, ws):
        return torch.ops.kmla.mla_forward(pos, hid, cache, ws, gpu.handle, step.handle) + 1

    got = torch.compile(f, fullgraph=True)(pos, hid, t, step.workspace)
    torch.cuda.synchronize()
    assert torch.equal(got, ref + 1) and torch.equal(t, t_ref)
    # merge and insert ops on CUDA equal the CPU ones
    po, so = torch.randn(6, 3, 128).bfloat16(), torch.randn(6, 3, 128).bfloat16()
    pl, sl = torch.randn(6, 3), torch.randn(6, 3)
    o, l = torch.ops.kmla.merge_attn_states(po.cuda(), pl.cuda(), so.cuda(), sl.cuda(), 4)
    ro, rl = kmla.merge_attn_states(po, pl, so, sl, 4)
    assert (o.cpu().float() - ro.float()).abs().max() <= 2 ** -7 * ro.float().abs().max()
    assert torch.allclose(l.cpu(), rl, rtol=1e-5, atol=1e-5)
    tc = torch.zeros(3, 16 * 656, dtype=torch.uint8, device="cuda")
    kv, kpe = torch.randn(4, 512).bfloat16(), torch.randn(4, 64).bfloat16()
    p4, s4 = torch.tensor([0, 9, 100, 7]), torch.tensor([3, -1, 40, 17])
    torch.ops.kmla.cache_insert(kv.cuda(), kpe.cuda(), p4.cuda(), s4.cuda(), tc, "fp8_ds_mla", 16, 1.0,
                                "power_of_two", gpu.handle)
    hc = kmla.LatentCache("fp8_ds_mla", 16, 3)
    kmla.cache_insert(kv, kpe, p4, s4, hc, cpu)
    dev = kmla.LatentCache.borrow(tc.cpu(), "fp8_ds_mla", 16)
    for s in (3, 40, 17):
        np.testing.assert_allclose(dev.read_row(s), hc.read_row(s), atol=np.abs(hc.read_row(s)).max() * 2 ** -3)


def test_cuda_graph_capture_replays_the_op():
    if not kmla.torch_ops.available:
        pytest.skip(kmla.torch_ops.reason)
    cpu, gpu = make_layers("kimi-k3", "bf16")
    # decode-only batch (graph-safe plan against a DecodeShape)
    case = mixed_batch(cpu, "bf16", requests=[(1, 20), (1, 33), (1, 5), (1, 16)], padding_rows=0,
                       decode_threshold=1)
    pos = torch.from_numpy(case.positions).cuda()
    hid = torch.from_numpy(case.hidden).bfloat16().cuda()
    t, c = device_cache(case)
    initial = t.clone()
    step = gpu.prepare(case.metadata, c, decode_shape={"max_requests": 4, "max_blocks": 4, "max_seq_len": 64})
    assert step.plan.graph_safe
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the graph, as torch recommends
        torch.ops.kmla.mla_forward(pos, hid, t, step.workspace, gpu.handle, step.handle)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.kmla.mla_forward(pos, hid, t, step.workspace, gpu.handle, step.handle)
    new_hidden = torch.randn_like(hid)
    hid.copy_(new_hidden)
    t.copy_(initial)
    g.replay()
    torch.cuda.synchronize()
    # The same plan (same launch configuration) run eagerly with its own workspace.
    t_ref, c_ref = device_cache(case)
    step_ref = gpu.prepare(case.metadata, c_ref, decode_shape={"max_requests": 4, "max_blocks": 4, "max_seq_len": 64})
    ref = torch.ops.kmla.mla_forward(pos, new_hidden, t_ref, step_ref.workspace, gpu.handle, step_ref.handle)
    gpu.check_errors()
    assert torch.equal(out, ref) and torch.equal(t, t_ref)
    # and it agrees with the oracle
    r = check_against_oracle(cpu, case.positions, new_hidden.float().cpu().numpy(), case.metadata, case.cache, out)
    assert r["pass"], r
