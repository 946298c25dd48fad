#!/usr/bin/env python3
"""Write kmla's checkpoint fixtures: three tiny Hugging Face model directories
(config.json + *.safetensors), saved with the standard `safetensors` library
(safetensors.torch.save_file), in which every stored value is a closed-form
function of (tensor name, flat index).

tests/test_checkpoint_fixtures.cpp recomputes the same formulas on its own and
checks that kmla reads exactly these values. README.md beside this file lists
the fixtures, the tensors and the formulas.

Usage:  python3 tests/checkpoints/make_checkpoints.py [--out DIR] [--tar FILE]
        (default --out: this folder). Needs torch >= 2.1 (float8_e4m3fn) and
        safetensors. Output is deterministic: same inputs, same bytes.
"""

import argparse
import hashlib
import io
import json
import os
import struct
import sys
import tarfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# ---------------------------------------------------------------------------
# The closed forms.  Keep in sync with tests/test_checkpoint_fixtures.cpp.
# ---------------------------------------------------------------------------
MOD = 1048573  # a prime just below 2**20
MUL_I = 7919
MUL_SALT = 104729
CENTER = 524286  # (MOD - 1) / 2
FP8_MUL_I = 131
FP8_MUL_SALT = 37
BLOCK = 128
K_SCALE = 0.5


def salt(name):
    """FNV-1a (32-bit) of the name's UTF-8 bytes, mod 65521."""
    h = 0x811C9DC5
    for b in name.encode("utf-8"):
        h ^= b
        h = (h * 0x01000193) & 0xFFFFFFFF
    return h % 65521


def base_values(name, n):
    """x(name, i) = (k - CENTER) * 2^-22 with k = (7919 i + 104729 salt) mod 1048573.

    |k - CENTER| < 2^19, so x is an exact float32 with |x| < 1/8."""
    i = torch.arange(n, dtype=torch.int64)
    k = (i * MUL_I + salt(name) * MUL_SALT) % MOD
    return (k - CENTER).to(torch.float32) * (2.0 ** -22)


def fp8_codes(name, n):
    """c = (131 i + 37 salt) mod 254; code = c, or c + 1 from 127 on (skips NaN 0x7F, 0xFF)."""
    i = torch.arange(n, dtype=torch.int64)
    c = (i * FP8_MUL_I + salt(name) * FP8_MUL_SALT) % 254
    return torch.where(c < 127, c, c + 1).to(torch.uint8)


def scale_grid(name, rows, cols):
    """s[r][c] = (9 + (7 r + 3 c + salt) mod 23) * 2^-(8 + (r + 2 c) mod 3), exact in float32."""
    r = torch.arange(rows, dtype=torch.int64).reshape(rows, 1)
    c = torch.arange(cols, dtype=torch.int64).reshape(1, cols)
    mant = 9 + (r * 7 + c * 3 + salt(name)) % 23
    pow2 = torch.tensor([2.0 ** -8, 2.0 ** -9, 2.0 ** -10], dtype=torch.float32)
    return mant.to(torch.float32) * pow2[(r + 2 * c) % 3]


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def make_tensor(name, dtype, shape):
    """The stored tensor for (name, dtype, shape), by the rules in README.md."""
    n = numel(shape)
    if name.endswith(".weight_scale_inv"):
        assert dtype == "F32" and len(shape) == 2
        return scale_grid(name, shape[0], shape[1])
    if name.endswith(".k_scale"):
        assert dtype == "F32" and n == 1
        return torch.full(shape, K_SCALE, dtype=torch.float32)
    if dtype == "F8_E4M3":
        return fp8_codes(name, n).reshape(shape).view(torch.float8_e4m3fn)
    x = base_values(name, n)
    if name.endswith("norm.weight"):
        x = 1.0 + x  # exact: x has no bits below 2^-22 and |x| < 1/8
    x = x.reshape(shape)
    if dtype == "BF16":
        return x.to(torch.bfloat16)  # round to nearest even
    assert dtype == "F32", dtype
    return x


# ---------------------------------------------------------------------------
# The model directories.
# ---------------------------------------------------------------------------
QK, KVB, V, LATENT, KV_LORA = 192, 256, 128, 576, 512


def attention(prefix, layer, heads, hidden, q_lora, gate, proj_dtype, norm_dtype="BF16"):
    """The MLA tensors of one layer, [out, in], as (name, dtype, shape)."""
    p = f"{prefix}model.layers.{layer}.self_attn."
    t = []
    if q_lora:
        t += [(p + "q_a_proj.weight", proj_dtype, [q_lora, hidden]),
              (p + "q_a_layernorm.weight", norm_dtype, [q_lora]),
              (p + "q_b_proj.weight", proj_dtype, [heads * QK, q_lora])]
    else:
        t += [(p + "q_proj.weight", proj_dtype, [heads * QK, hidden])]
    t += [(p + "kv_a_proj_with_mqa.weight", proj_dtype, [LATENT, hidden]),
          (p + "kv_a_layernorm.weight", norm_dtype, [KV_LORA]),
          (p + "kv_b_proj.weight", proj_dtype, [heads * KVB, KV_LORA])]
    if gate:
        t += [(p + "g_proj.weight", proj_dtype, [heads * V, hidden])]
    t += [(p + "o_proj.weight", proj_dtype, [hidden, heads * V])]
    return with_scales(t)


def with_scales(tensors):
    """Adds a weight_scale_inv F32 [ceil(out/128), ceil(in/128)] after every F8_E4M3 matrix."""
    out = []
    for name, dtype, shape in tensors:
        out.append((name, dtype, shape))
        if dtype == "F8_E4M3":
            assert name.endswith(".weight") and len(shape) == 2
            out.append((name[: -len("weight")] + "weight_scale_inv", "F32",
                        [(shape[0] + BLOCK - 1) // BLOCK, (shape[1] + BLOCK - 1) // BLOCK]))
    return out


def k3_tiny():
    """Kimi-K3 style: multimodal wrapper, LM under language_model., bf16, two shards."""
    H, hidden, q_lora, vocab = 4, 256, 96, 32
    lm = "language_model."
    config = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "torch_dtype": "bfloat16",
        "text_config": {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": 32,
            "num_hidden_layers": 4,
            "num_attention_heads": H,
            "num_key_value_heads": H,
            "q_lora_rank": q_lora,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "mla_use_nope": True,
            "mla_use_output_gate": True,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "linear_attn_config": {
                "full_attn_layers": [2, 4],
                "kda_layers": [1, 3],
                "num_heads": H,
                "head_dim": 128,
                "short_conv_kernel_size": 4,
                "use_full_rank_gate": True,
                "gate_lower_bound": -5.0,
            },
            "torch_dtype": "bfloat16",
        },
        "vision_config": {"model_type": "kimi_k3_vision", "hidden_size": 16},
    }
    l1 = attention(lm, 1, H, hidden, q_lora, True, "BF16")
    l3 = attention(lm, 3, H, hidden, q_lora, True, "BF16")
    # Real shards cut through layers: layer 1's attention is split over both files.
    shard1 = [
        (lm + "model.embed_tokens.weight", "BF16", [vocab, hidden]),
        ("vision_tower.encoder.blocks.0.wqkv.weight", "BF16", [48, 16]),
        # Layer 0 is a KDA layer: it has self_attn tensors, none of them MLA.
        (lm + "model.layers.0.self_attn.A_log", "F32", [1, 1, H, 1]),
        (lm + "model.layers.0.self_attn.dt_bias", "F32", [H * 128]),
    ] + l1[:5]
    shard2 = l1[5:] + [
        (lm + "model.layers.1.mlp.down_proj.weight", "BF16", [hidden, 32]),
        (lm + "model.layers.1.input_layernorm.weight", "BF16", [hidden]),
    ] + l3 + [(lm + "model.norm.weight", "BF16", [hidden])]
    return config, {"model-00001-of-00002.safetensors": shard1,
                    "model-00002-of-00002.safetensors": shard2}


def kimi_linear_tiny():
    """Kimi-Linear style: no q-LoRA (q_proj), no gate, one file, a k_scale."""
    H, hidden, vocab = 3, 192, 32
    config = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 32,
        "head_dim": hidden // H,
        "num_hidden_layers": 2,
        "num_attention_heads": H,
        "num_key_value_heads": H,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "model_max_length": 1048576,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "linear_attn_config": {
            "full_attn_layers": [2],
            "kda_layers": [1],
            "num_heads": H,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
        },
        "torch_dtype": "bfloat16",
    }
    tensors = [
        ("model.embed_tokens.weight", "BF16", [vocab, hidden]),
        ("model.layers.0.self_attn.A_log", "F32", [1, 1, H, 1]),
        ("model.layers.0.self_attn.dt_bias", "F32", [H * 128]),
        ("model.layers.0.mlp.gate_proj.weight", "BF16", [32, hidden]),
    ] + attention("", 1, H, hidden, None, False, "BF16") + [
        ("model.layers.1.self_attn.k_scale", "F32", []),
        ("model.norm.weight", "BF16", [hidden]),
        ("lm_head.weight", "BF16", [vocab, hidden]),
    ]
    return config, {"model.safetensors": tensors}


def dsv3_fp8_tiny():
    """DeepSeek-V3 style: fp8 e4m3 projections with 128x128 weight_scale_inv, YaRN,
    and an MTP layer (layer 1) beyond num_hidden_layers."""
    H, hidden, q_lora, vocab = 2, 256, 128, 32
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_nextn_predict_layers": 1,
        "first_k_dense_replace": 1,
        "num_attention_heads": H,
        "num_key_value_heads": H,
        "q_lora_rank": q_lora,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    }
    tensors = [("model.embed_tokens.weight", "BF16", [vocab, hidden])]
    tensors += attention("", 0, H, hidden, q_lora, False, "F8_E4M3")
    tensors += with_scales([
        ("model.layers.0.input_layernorm.weight", "BF16", [hidden]),
        ("model.layers.0.mlp.gate_proj.weight", "F8_E4M3", [64, hidden]),
    ])
    # The multi-token-prediction layer: MLA-shaped attention, but not one of the model's layers.
    tensors += attention("", 1, H, hidden, q_lora, False, "F8_E4M3")
    tensors += [
        ("model.layers.1.enorm.weight", "BF16", [hidden]),
        ("model.layers.1.hnorm.weight", "BF16", [hidden]),
        ("model.layers.1.shared_head.norm.weight", "BF16", [hidden]),
        ("model.norm.weight", "BF16", [hidden]),
        ("lm_head.weight", "BF16", [vocab, hidden]),
    ]
    return config, {"model.safetensors": tensors}


FIXTURES = {"k3_tiny": k3_tiny, "kimi_linear_tiny": kimi_linear_tiny, "dsv3_fp8_tiny": dsv3_fp8_tiny}

# ---------------------------------------------------------------------------
# Writing and checking.
# ---------------------------------------------------------------------------
ST_NAME = {"BF16": "BF16", "F32": "F32", "F8_E4M3": "F8_E4M3"}
ELEM = {"BF16": 2, "F32": 4, "F8_E4M3": 1}


def bits(t):
    """A tensor's raw bits, for bitwise comparison."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t.view(torch.uint8)


def check_rounding(x32, b16):
    """torch's float32 -> bf16 agrees with a hand-written round-to-nearest-even."""
    u = x32.reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    got = b16.reshape(-1).view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(r, got), "torch bf16 rounding differs from round-to-nearest-even"


def check_fp8_decode():
    """torch's e4m3fn decoding agrees with the format's definition for all 254 finite codes."""
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    got = codes.view(torch.float8_e4m3fn).to(torch.float64)
    for c, v in zip(codes.tolist(), got.tolist()):
        e, m = (c >> 3) & 0xF, c & 7
        want = m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        want = -want if c & 0x80 else want
        assert v == want or (v == 0 and want == 0), (c, v, want)


def read_header(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), len(data) - 8 - n


def write_fixture(root, name):
    config, shards = FIXTURES[name]()
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):  # stale files would be read by the loader
        if f.endswith(".safetensors") or f.endswith(".json"):
            os.remove(os.path.join(d, f))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    weight_map, total = {}, 0
    for fname, specs in shards.items():
        tensors = {}
        for tname, dtype, shape in specs:
            assert tname not in tensors and tname not in weight_map, tname
            t = make_tensor(tname, dtype, shape)
            assert list(t.shape) == list(shape), (tname, t.shape, shape)
            if dtype == "BF16":
                x = base_values(tname, numel(shape)).reshape(shape)
                check_rounding(1.0 + x if tname.endswith("norm.weight") else x, t)
            tensors[tname] = t
            weight_map[tname] = fname
            total += numel(shape) * ELEM[dtype]
        path = os.path.join(d, fname)
        save_file(tensors, path, metadata={"format": "pt"})
        # Read back with the library, bit for bit.
        with safe_open(path, framework="pt") as f:
            assert sorted(f.keys()) == sorted(tensors), path
            for k in f.keys():
                assert torch.equal(bits(f.get_tensor(k)), bits(tensors[k])), (path, k)
        # And the raw header: dtype names, shapes, offsets inside the payload, no overlap.
        header, payload = read_header(path)
        ranges = []
        for tname, dtype, shape in specs:
            h = header[tname]
            assert h["dtype"] == ST_NAME[dtype] and h["shape"] == list(shape), (tname, h)
            b, e = h["data_offsets"]
            assert 0 <= b <= e <= payload and e - b == numel(shape) * ELEM[dtype], (tname, h)
            ranges.append((b, e))
        ranges.sort()
        assert all(ranges[i][0] >= ranges[i - 1][1] for i in range(1, len(ranges))), path
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    files = sorted(os.listdir(d))
    print(f"{name}: {len(weight_map)} tensors, {total} payload bytes")
    for f in files:
        p = os.path.join(d, f)
        with open(p, "rb") as fh:
            digest = hashlib.sha256(fh.read()).hexdigest()[:16]
        print(f"  {f:40s} {os.path.getsize(p):9d} B  sha256 {digest}")
    return d


def write_tar(root, names, tar_path):
    """One tar of the fixture folders, with fixed metadata (a reproducible archive)."""
    with tarfile.open(tar_path, "w") as tar:
        for name in names:
            for f in sorted(os.listdir(os.path.join(root, name))):
                p = os.path.join(root, name, f)
                info = tarfile.TarInfo(f"{name}/{f}")
                info.size = os.path.getsize(p)
                info.mode, info.mtime, info.uid, info.gid = 0o644, 0, 0, 0
                with open(p, "rb") as fh:
                    tar.addfile(info, io.BytesIO(fh.read()))


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=here, help="folder to write the fixture folders into")
    ap.add_argument("--tar", help="also pack the fixture folders into this tar file")
    args = ap.parse_args()
    import safetensors

    print(f"torch {torch.__version__}, safetensors {safetensors.__version__}")
    check_fp8_decode()
    os.makedirs(args.out, exist_ok=True)
    for name in FIXTURES:
        write_fixture(args.out, name)
    if args.tar:
        write_tar(args.out, list(FIXTURES), args.tar)
        print(f"wrote {args.tar} ({os.path.getsize(args.tar)} B)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
