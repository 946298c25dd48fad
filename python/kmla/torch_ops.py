"""torch.library custom ops over the kmla layer and stages (torch >= 2.4).

    step = layer.prepare(metadata, cache)            # host: plan (+ upload on CUDA)
    out = torch.ops.kmla.mla_forward(positions, hidden, cache.tensor, step.workspace,
                                     layer.handle, step.handle)
    torch.ops.kmla.cache_insert(kv_c_normed, k_pe, positions, slot_mapping, cache.tensor,
                                "bf16", block_size, k_scale, "power_of_two", layer.handle)
    out, lse = torch.ops.kmla.merge_attn_states(prefix_out, prefix_lse, suffix_out,
                                                suffix_lse, rows_with_prefix)

The cache is the caller's tensor (``LatentCache.borrow``), declared mutated. The layer and the
planned step are passed by handle: the batch is planned on the host outside the op (like an
engine's attention metadata), so a CUDA graph captured from the op replays the uploaded plan.
CUDA ops run on torch's current stream. Each op has a fake (meta) implementation, so
torch.compile traces it without running it.

On older torch (Debian's 1.13 has no torch.library.custom_op) nothing is registered:
``available`` is False and ``reason`` says why; the rest of kmla works with torch tensors.
"""

import torch

from . import Error, _dl, _kmla, _layers, _steps

available = hasattr(torch, "library") and hasattr(torch.library, "custom_op")
reason = ("" if available
          else f"torch {torch.__version__} has no torch.library.custom_op (needs >= 2.4)")


def _live(registry, handle, what):
    obj = registry.get(handle)
    if obj is None:
        raise Error(f"no live {what} with handle {handle} "
                    "(keep the object alive while its ops run)")
    return obj


def _stream(t):
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


if available:
    from torch import Tensor

    @torch.library.custom_op("kmla::mla_forward", mutates_args=("cache",))
    def mla_forward(positions: Tensor, hidden_states: Tensor, cache: Tensor, workspace: Tensor,
                    layer: int, step: int) -> Tensor:
        lay, st = _live(_layers, layer, "MlaLayer"), _live(_steps, step, "prepared step")
        out = torch.empty_like(hidden_states)
        stream = _stream(hidden_states)
        c = _kmla.Cache.borrow(_dl(cache), st.cache_format, st.block_size, st.k_scale,
                               st.tile_rule, stream)
        if hidden_states.is_cuda:
            lay._impl.run(st.plan, _dl(positions), _dl(hidden_states), c, _dl(out), _dl(workspace),
                          stream)
        else:
            lay._impl.forward(_dl(positions), _dl(hidden_states), st.metadata, c, _dl(out), 0)
        return out

    @mla_forward.register_fake
    def _(positions, hidden_states, cache, workspace, layer, step):
        return torch.empty_like(hidden_states)

    @torch.library.custom_op("kmla::cache_insert", mutates_args=("cache",))
    def cache_insert(kv_c_normed: Tensor, k_pe: Tensor, positions: Tensor, slot_mapping: Tensor,
                     cache: Tensor, cache_format: str, block_size: int, k_scale: float,
                     tile_rule: str, layer: int) -> None:
        from . import LatentCache, cache_insert as insert  # noqa: PLC0415

        c = LatentCache.borrow(cache, cache_format, block_size, k_scale, tile_rule)
        rope = _live(_layers, layer, "MlaLayer") if layer >= 0 else None
        act = "f16" if kv_c_normed.dtype == torch.float16 else "bf16"
        insert(kv_c_normed, k_pe, positions, slot_mapping, c, rope, activation=act)

    @cache_insert.register_fake
    def _(kv_c_normed, k_pe, positions, slot_mapping, cache, cache_format, block_size, k_scale,
          tile_rule, layer):
        return None

    @torch.library.custom_op("kmla::merge_attn_states", mutates_args=())
    def merge_attn_states(prefix_out: Tensor, prefix_lse: Tensor, suffix_out: Tensor,
                          suffix_lse: Tensor, rows_with_prefix: int) -> tuple[Tensor, Tensor]:
        out = torch.empty_like(prefix_out)
        out_lse = torch.empty_like(prefix_lse)
        act = "f16" if prefix_out.dtype == torch.float16 else "bf16"
        _kmla.merge_attn_states(_dl(prefix_out), _dl(prefix_lse), _dl(suffix_out), _dl(suffix_lse),
                                rows_with_prefix, _dl(out), _dl(out_lse), act, _stream(prefix_out))
        return out, out_lse

    @merge_attn_states.register_fake
    def _(prefix_out, prefix_lse, suffix_out, suffix_lse, rows_with_prefix):
        return torch.empty_like(prefix_out), torch.empty_like(prefix_lse)
