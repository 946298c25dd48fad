#!/usr/bin/env python3
"""Loads one MLA layer of a Hugging Face checkpoint, serves two steps through a paged cache
(a prefill step, then a mixed step of decodes, a chunked prefill with context and a fresh
prefill), and checks each step's output against kmla's fp64 oracle.

    PYTHONPATH=build/python python3 python/examples/check_checkpoint.py tests/checkpoints/k3_tiny
    ... --device cuda   (torch tensors on the GPU; needs torch with CUDA and kmla's CUDA backend)
"""
import argparse
import sys

import numpy as np

import kmla
from kmla.testing import check_against_oracle, round_to


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a Hugging Face model directory (config.json + safetensors)")
    ap.add_argument("--layer", type=int, default=None, help="MLA layer index (default: the first)")
    ap.add_argument("--cache-format", default="bf16", choices=kmla.cache_formats())
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()

    hf = kmla.load_hf_config(args.checkpoint)
    layer_index = hf.mla_layers[0] if args.layer is None else args.layer
    act = "f16" if args.cache_format == "fp16" else "bf16"
    layer = kmla.MlaLayer.from_checkpoint(args.checkpoint, layer_index, device=args.device,
                                          activation=act)
    cfg = layer.config
    print(f"checkpoint: {args.checkpoint} ({hf.model_type}), MLA layers {hf.mla_layers}, "
          f"using layer {layer_index}")
    print(f"layer: hidden {cfg.hidden_size}, heads {cfg.num_heads}, q_lora {cfg.q_lora_rank}, "
          f"gate {cfg.use_output_gate}, rope {cfg.use_rope}, softmax scale {cfg.softmax_scale:.6f}")

    bs = args.block_size
    cache = kmla.LatentCache(args.cache_format, bs, 32, k_scale=layer.weights.k_scale)
    if args.device == "cuda":  # the GPU layer works on a device cache and torch CUDA tensors
        import torch
        dev_bytes = torch.zeros(cache.num_blocks, cache.block_stride, dtype=torch.uint8,
                                device="cuda")
        cache = kmla.LatentCache.borrow(dev_bytes, args.cache_format, bs,
                                        k_scale=layer.weights.k_scale)
    # Blocks handed out out of order, as an engine's block manager would.
    free = list(np.random.default_rng(0).permutation(32))
    tables = {name: [] for name in "ABCD"}
    lengths = {name: 0 for name in "ABCD"}
    rng = np.random.default_rng(1)

    def step(title, new_tokens):
        names = list(new_tokens)
        for n in names:
            while len(tables[n]) * bs < lengths[n] + new_tokens[n]:
                tables[n].append(int(free.pop()))
        md = kmla.plan_batch([new_tokens[n] for n in names], [lengths[n] for n in names],
                             [tables[n] for n in names], cache, decode_threshold=1, num_rows=0,
                             workspace_tokens=24)  # small workspace: the context is chunked
        caller = round_to(rng.standard_normal((md.num_tokens, cfg.hidden_size)), act)
        hidden, positions = md.to_layout(caller), md.positions
        before = cache.to_host()
        if args.device == "cuda":
            import torch
            tdt = torch.bfloat16 if act == "bf16" else torch.float16
            out = layer.forward(torch.from_numpy(positions).cuda(),
                                torch.from_numpy(hidden).to(tdt).cuda(), md, cache)
            layer.check_errors()
            out = out.float().cpu().numpy()
        else:
            out = layer.forward(positions, hidden, md, cache)
        r = check_against_oracle(layer, positions, hidden, md, before, out)
        kinds = [md.kind(i) for i in range(md.num_requests)]
        print(f"{title}: {md.num_tokens} tokens, {kinds.count('decode')} decode, "
              f"{kinds.count('context_prefill')} prefill with context "
              f"({md.num_context_chunks} chunks), "
              f"{kinds.count('fresh_prefill')} fresh prefill; max |out| {r['max_ref']:.4f}, "
              f"error {r['err']:.2e} <= bound {r['bound']:.2e}: {'ok' if r['pass'] else 'FAIL'}")
        for n in names:
            lengths[n] += new_tokens[n]
        return r["pass"]

    ok = step("step 1", {"A": 21, "B": 40, "C": 3})
    ok &= step("step 2", {"A": 1, "C": 1, "B": 9, "D": 17})
    ok &= step("step 3", {"A": 1, "B": 1, "C": 1, "D": 1})
    print("check: PASS" if ok else "check: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
