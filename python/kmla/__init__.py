"""kmla: the Multi-head Latent Attention layer of Kimi-K3 / DeepSeek, from Python.

The C++ library is the engine; this package is bindings (``_kmla``) plus glue:

* ``MlaConfig`` (``preset``, ``from_hf``, ``small``), ``LatentCache``, ``plan_batch`` ->
  ``BatchMetadata``, ``MlaLayer`` with ``forward(positions, hidden_states, metadata, cache)``,
  and ``MlaLayer.oracle`` (the fp64 reference) to check any result.
* Arrays: NumPy arrays on the CPU (activations as float32: NumPy has no bf16, so they are
  rounded to the layer's bf16/f16 on the way in and widened on the way out), and torch
  tensors through DLPack on the CPU and on CUDA (bf16/f16 in place, no copy).
* With torch >= 2.4: ``torch.ops.kmla.mla_forward``, ``kmla::cache_insert`` and
  ``kmla::merge_attn_states`` custom ops with fake implementations (torch.compile, CUDA
  graphs); see ``kmla.torch_ops``.

Wrong dtype, device, shape or strides raise ``kmla.Error`` (a RuntimeError) with the C++
message.
"""

from __future__ import annotations

import itertools
import weakref

from . import _kmla
from ._kmla import (  # noqa: F401
    BatchMetadata,
    Error,
    HfModelConfig,
    MlaConfig,
    MlaWeights,
    RopeParams,
    RopeTable,
    built_with_cuda,
    cache_entry_bytes,
    cache_formats,
    cuda_available,
    load_hf_config,
)

__all__ = [
    "Error", "MlaConfig", "RopeParams", "HfModelConfig", "load_hf_config", "MlaWeights",
    "RopeTable",
    "LatentCache", "BatchMetadata", "plan_batch", "MlaLayer", "cache_insert", "merge_attn_states",
    "decode_attention", "prefill_attention", "to_layout", "from_layout", "built_with_cuda",
    "cuda_available", "preset_names", "cache_formats", "cache_entry_bytes", "torch_ops",
]

preset_names = MlaConfig.preset_names
Error.__module__ = "kmla"


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _torch():
    import torch  # noqa: PLC0415 (torch is optional)

    return torch


def _stream_of(x) -> int:
    """The current CUDA stream (as an int) for a CUDA torch tensor, else 0."""
    if _is_torch(x) and x.is_cuda:
        torch = _torch()
        return torch.cuda.current_stream(x.device).cuda_stream
    return 0


def _dl(x):
    """What the bindings read: NumPy arrays as they are, torch tensors as DLPack capsules
    (``to_dlpack`` shares memory and does no stream synchronization; without it the bindings
    call ``__dlpack__`` with the stream they run on)."""
    if _is_torch(x):
        x = x.detach()
        to_dlpack = getattr(_torch().utils.dlpack, "to_dlpack", None)
        return to_dlpack(x) if to_dlpack is not None else x
    return x


# ---- the cache -------------------------------------------------------------------------
class LatentCache:
    """The paged latent cache: ``num_blocks`` blocks of ``block_size`` rows in one of the
    formats ``bf16``, ``fp16``, ``fp8`` (per-tensor ``k_scale``) or ``fp8_ds_mla``.

    ``LatentCache(format, block_size, num_blocks, device="cpu")`` allocates zeroed memory
    owned by kmla (host, or device with ``device="cuda"``); ``LatentCache.borrow(tensor,
    format, block_size)`` uses a caller's array (NumPy or torch, CPU or CUDA, C-contiguous,
    dim 0 counting blocks, e.g. uint8 ``[num_blocks, block_size * entry_bytes]``) in place.
    """

    def __init__(self, format="bf16", block_size=64, num_blocks=0, k_scale=1.0,
                 tile_rule="power_of_two", device="cpu", *, _impl=None, _tensor=None):
        self._impl = _impl if _impl is not None else _kmla.Cache.allocate(
            format, block_size, num_blocks, k_scale, tile_rule, device)
        self.tensor = _tensor  # the borrowed array, if any

    @classmethod
    def borrow(cls, tensor, format, block_size, k_scale=1.0, tile_rule="power_of_two"):
        impl = _kmla.Cache.borrow(_dl(tensor), format, block_size, k_scale, tile_rule,
                                  _stream_of(tensor))
        return cls(_impl=impl, _tensor=tensor)

    @staticmethod
    def entry_bytes_of(format) -> int:
        return cache_entry_bytes(format)

    format = property(lambda self: self._impl.format)
    block_size = property(lambda self: self._impl.block_size)
    num_blocks = property(lambda self: self._impl.num_blocks)
    num_slots = property(lambda self: self._impl.num_slots)
    block_stride = property(lambda self: self._impl.block_stride)
    entry_bytes = property(lambda self: self._impl.entry_bytes)
    device = property(lambda self: self._impl.device)
    tile_rule = property(lambda self: self._impl.tile_rule)
    data_ptr = property(lambda self: self._impl.data_ptr)

    @property
    def k_scale(self) -> float:
        return self._impl.k_scale

    @k_scale.setter
    def k_scale(self, value: float):
        self._impl.k_scale = value

    def bytes(self):
        """uint8 [num_blocks, block_stride]: a view of host memory, a copy of device memory."""
        return self._impl.bytes()

    def to_host(self) -> "LatentCache":
        """A host copy with the same geometry (e.g. for the oracle)."""
        return LatentCache(_impl=self._impl.to_host())

    clone = to_host

    def copy_from(self, other: "LatentCache"):
        """Copies all bytes of a cache with the same geometry (host or device, either way)."""
        self._impl.copy_from(other._impl)

    def fill(self, byte: int):
        """Sets every byte (host caches); 0xFF is NaN in every format."""
        self._impl.fill(byte)

    def read_row(self, slot):
        return self._impl.read_row(slot)

    def write_row(self, slot, row):
        self._impl.write_row(slot, row)

    def __repr__(self):
        return (f"LatentCache(format={self.format!r}, block_size={self.block_size}, "
                f"num_blocks={self.num_blocks}, device={self.device!r})")


def _cache_impl(cache):
    return cache._impl if isinstance(cache, LatentCache) else cache


# ---- batch metadata --------------------------------------------------------------------
def plan_batch(query_lens, context_lens, block_tables, cache, *, decode_threshold=1,
               non_causal_decode=False, keep_order=False, num_rows=0, workspace_tokens=65536,
               slot_mapping=None) -> BatchMetadata:
    """Plans a batch from per-request lengths and block tables (in any order) against a
    cache's geometry: decodes first, then prefills with context, then fresh prefills.
    Rows of ``hidden_states`` must then follow the layout: see ``to_layout``."""
    def ints(x):
        return x.tolist() if hasattr(x, "tolist") else x
    slots = None if slot_mapping is None else ints(slot_mapping)
    return _kmla.plan_batch(ints(query_lens), ints(context_lens), [ints(t) for t in block_tables],
                            _cache_impl(cache), decode_threshold, non_causal_decode, keep_order,
                            num_rows, workspace_tokens, slots)


def to_layout(metadata: BatchMetadata, x):
    """Rows in the callers' order (requests as given, tokens consecutive) -> the metadata's
    layout, with zero padding rows: a NumPy array or torch tensor of ``num_tokens`` rows."""
    order = metadata.row_order
    if _is_torch(x):
        torch = _torch()
        out = torch.zeros((metadata.num_rows,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        out[: metadata.num_tokens] = x.index_select(0, torch.from_numpy(order).to(x.device))
        return out
    import numpy as np  # noqa: PLC0415

    out = np.zeros((metadata.num_rows,) + x.shape[1:], dtype=x.dtype)
    out[: metadata.num_tokens] = x[order]
    return out


def from_layout(metadata: BatchMetadata, y):
    """The inverse of ``to_layout``: layout rows back to the callers' order (padding dropped)."""
    order = metadata.row_order
    if _is_torch(y):
        torch = _torch()
        shape = (metadata.num_tokens,) + tuple(y.shape[1:])
        out = torch.empty(shape, dtype=y.dtype, device=y.device)
        out[torch.from_numpy(order).to(y.device)] = y[: metadata.num_tokens]
        return out
    import numpy as np  # noqa: PLC0415

    out = np.empty((metadata.num_tokens,) + y.shape[1:], dtype=y.dtype)
    out[order] = y[: metadata.num_tokens]
    return out


BatchMetadata.to_layout = to_layout
_validate_batch = BatchMetadata.validate
BatchMetadata.validate = lambda self, cache: _validate_batch(self, _cache_impl(cache))
BatchMetadata.validate.__doc__ = "Checks the metadata against a cache's geometry (else kmla.Error)."
BatchMetadata.from_layout = from_layout

# ---- the layer ---------------------------------------------------------------------------
_handles = itertools.count(1)
# handle -> object, for the torch ops; weak, so dropping a layer or step frees it (keep a step
# alive as long as a CUDA graph captured with it).
_layers = weakref.WeakValueDictionary()
_steps = weakref.WeakValueDictionary()


class MlaLayer:
    """One MLA layer on the CPU (``device="cpu"``) or the GPU (``device="cuda"``).

    ``forward(positions, hidden_states, metadata, cache)`` computes the layer for a batch
    planned with ``plan_batch`` (rows in the metadata's layout; padding rows get zeros) and
    writes the new tokens' latents into ``cache``. NumPy float32 in -> NumPy float32 out;
    torch bf16/f16 in -> torch out (on the tensors' device, on torch's current stream).
    On the GPU, ``tune_gemms=True`` makes a forward that meets a new projection shape first
    time cuBLASLt's candidate algorithms for it and keep the fastest (that call synchronizes).
    """

    def __init__(self, config: MlaConfig, weights: MlaWeights, *, activation="bf16",
                 fp8_prefill=False, partial_output=None, device="cpu", num_threads=0,
                 portable=False, rope_rows=0, tune_gemms=False):
        if partial_output is None:
            partial_output = config.tp_size > 1
        self._impl = _kmla.Layer(config, weights, activation, fp8_prefill, partial_output,
                                 str(device), num_threads, portable, rope_rows, tune_gemms)
        self.handle = next(_handles)
        self._rope_tensor = None
        self._graph_keepalive = []
        _layers[self.handle] = self

    @classmethod
    def from_checkpoint(cls, path, layer, *, tp_rank=0, tp_size=1, **kw) -> "MlaLayer":
        """Layer ``layer`` (0-based, an MLA layer of the model) of a Hugging Face directory."""
        cfg = MlaConfig.from_hf(path)
        if tp_size > 1:
            cfg = cfg.tp_slice(tp_rank, tp_size)
        weights = MlaWeights.from_checkpoint(str(path), layer, cfg, kw.get("activation", "bf16"))
        return cls(cfg, weights, **kw)

    @classmethod
    def from_arrays(cls, config, arrays: dict, *, k_scale=1.0, q_scale=1.0, **kw) -> "MlaLayer":
        """From ``{name: array}`` with Hugging Face names (``q_a_proj``, ``kv_b_proj``, ...,
        [out, in]); NumPy float32 is rounded to the activation dtype, torch tensors copied."""
        arrays = {k: (v.detach().cpu() if _is_torch(v) else v) for k, v in arrays.items()}
        arrays = {k: _dl(v) for k, v in arrays.items()}
        act = kw.get("activation", "bf16")
        weights = MlaWeights.from_arrays(config, arrays, act, k_scale, q_scale)
        return cls(config, weights, **kw)

    @classmethod
    def random(cls, config, seed=1, **kw) -> "MlaLayer":
        return cls(config, MlaWeights.random(config, seed, kw.get("activation", "bf16")), **kw)

    config = property(lambda self: self._impl.config)
    weights = property(lambda self: self._impl.weights)
    rope = property(lambda self: self._impl.rope)
    activation = property(lambda self: self._impl.activation)
    device = property(lambda self: self._impl.device)

    def _torch_dtype(self):
        torch = _torch()
        return torch.bfloat16 if self.activation == "bf16" else torch.float16

    def forward(self, positions, hidden_states, metadata, cache, out=None):
        impl = _cache_impl(cache)
        if _is_torch(hidden_states):
            if out is None:
                out = _torch().empty_like(hidden_states)
            stream = _stream_of(hidden_states)
            self._impl.forward(_dl(positions), _dl(hidden_states), metadata, impl, _dl(out), stream)
            return out
        return self._impl.forward(_dl(positions), hidden_states, metadata, impl,
                                  None if out is None else _dl(out), 0)

    __call__ = forward

    def oracle(self, positions, hidden_states, metadata, cache, *, rounding="exact",
               attn_out=False):
        """The fp64 oracle on this layer's config and weights. Reads and WRITES ``cache``
        (a host cache: pass a copy made before ``forward``). Returns float64 NumPy
        [rows, hidden] (and the attention output before the gate with ``attn_out``)."""
        def host(x):
            return x.detach().cpu() if _is_torch(x) else x
        cache = _cache_impl(cache)
        out, attn = self._impl.oracle(_dl(host(positions)), _dl(host(hidden_states)), metadata,
                                      cache, rounding)
        return (out, attn) if attn_out else out

    # ---- CUDA graphs: plan once, upload, then run (capturable) ----
    def prepare(self, metadata, cache, decode_shape=None):
        """For the torch op: validates and plans the batch on the host. On CUDA it also
        allocates a workspace (torch) and uploads the plan's metadata on the current
        stream, so a graph captured from ``torch.ops.kmla.mla_forward`` replays it."""
        return _Step(self, metadata, cache, decode_shape)

    def check_errors(self):
        """CUDA: synchronizes and raises if a kernel refused a slot, block id or position."""
        if self.device == "cuda":
            self._impl.check_errors(_torch().cuda.current_stream().cuda_stream)

    def rope_table_tensor(self, device):
        """The RoPE table as a float32 torch tensor [rows, 64] on ``device`` (None without RoPE)."""
        if self.rope is None:
            return None
        if self._rope_tensor is None or str(self._rope_tensor.device) != str(device):
            self._rope_tensor = _torch().from_numpy(self.rope.table()).to(device)
        return self._rope_tensor


class _Step:
    def __init__(self, layer, metadata, cache, decode_shape):
        self.layer, self.metadata = layer, metadata
        self.cache_format, self.block_size = cache.format, cache.block_size
        self.k_scale, self.tile_rule = cache.k_scale, cache.tile_rule
        self.handle = next(_handles)
        self.plan = None
        torch = _torch()
        if layer.device == "cuda":
            self.plan = layer._impl.plan(metadata, _cache_impl(cache), decode_shape)
            self.workspace = torch.empty(max(self.plan.workspace_bytes, 1), dtype=torch.uint8,
                                         device="cuda")
            stream = torch.cuda.current_stream().cuda_stream
            layer._impl.upload(self.plan, _dl(self.workspace), stream)
        else:
            metadata.validate(_cache_impl(cache))
            self.workspace = torch.empty(0, dtype=torch.uint8)
        _steps[self.handle] = self

    def release(self):
        _steps.pop(self.handle, None)


# ---- stages ------------------------------------------------------------------------------
def cache_insert(kv_c_normed, k_pe, positions, slot_mapping, cache, rope=None, *,
                 activation="bf16"):
    """Writes [kv_c_normed | rope(k_pe)] rows into ``cache`` at ``slot_mapping`` (>= 0).
    ``rope``: a RopeTable (or an MlaLayer, whose table is used), or None (k_pe stored as is)."""
    if isinstance(rope, MlaLayer):
        layer, rope = rope, rope.rope
    else:
        layer = None
    impl = _cache_impl(cache)
    if impl.device == "cuda":
        torch = _torch()
        if rope is not None:
            table = (layer.rope_table_tensor("cuda") if layer
                     else torch.from_numpy(rope.table()).cuda())
        else:
            table = None
        ws = torch.empty(max(_kmla.cache_insert_workspace_bytes(kv_c_normed.shape[0]), 1),
                         dtype=torch.uint8, device="cuda")
        _kmla.cache_insert(_dl(kv_c_normed), _dl(k_pe), _dl(positions), _dl(slot_mapping), impl,
                           None, _dl(table) if table is not None else None, _dl(ws), activation,
                           _stream_of(kv_c_normed))
        return
    _kmla.cache_insert(_dl(kv_c_normed), _dl(k_pe), _dl(positions), _dl(slot_mapping), impl, rope,
                       None, None, activation, 0)


def merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse, rows_with_prefix=None, *,
                      out=None, out_lse=None, activation="bf16"):
    """Merges two partial attention results by their natural-log LSEs -> (out, out_lse)."""
    if rows_with_prefix is None:
        rows_with_prefix = prefix_out.shape[0]
    if _is_torch(prefix_out):
        torch = _torch()
        if out is None:
            out = torch.empty_like(prefix_out)
        if out_lse is None:
            out_lse = torch.empty_like(prefix_lse)
        _kmla.merge_attn_states(_dl(prefix_out), _dl(prefix_lse), _dl(suffix_out), _dl(suffix_lse),
                                rows_with_prefix, _dl(out), _dl(out_lse), activation,
                                _stream_of(prefix_out))
        return out, out_lse
    return _kmla.merge_attn_states(prefix_out, prefix_lse, suffix_out, suffix_lse, rows_with_prefix,
                                   out, out_lse, activation, 0)


def decode_attention(q, cache, metadata, softmax_scale, *, q_scale=1.0, out=None, lse=None,
                     activation="bf16"):
    """Absorbed MQA over the latent cache for the decode rows (CPU): q [Td, H, 576] ->
    (out [Td, H, 512], lse [Td, H])."""
    if _is_torch(q):
        torch = _torch()
        if out is None:
            out = torch.empty((q.shape[0], q.shape[1], 512), dtype=q.dtype)
        if lse is None:
            lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32)
        _kmla.decode_attention(_dl(q), q_scale, _cache_impl(cache), metadata, softmax_scale,
                               _dl(out), _dl(lse), activation)
        return out, lse
    return _kmla.decode_attention(q, q_scale, _cache_impl(cache), metadata, softmax_scale, out, lse,
                                  activation)


def prefill_attention(q, k, v, cu_q, cu_k, causal, softmax_scale, *, out=None, lse=None,
                      activation="bf16"):
    """Variable-length attention (CPU), q/k [T, H, 192], v [T, H, 128] -> (out, lse)."""
    cu_q, cu_k = [int(i) for i in cu_q], [int(i) for i in cu_k]
    if _is_torch(q):
        torch = _torch()
        if out is None:
            out = torch.empty((q.shape[0], q.shape[1], 128), dtype=q.dtype)
        if lse is None:
            lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32)
        _kmla.prefill_attention(_dl(q), _dl(k), _dl(v), cu_q, cu_k, causal, softmax_scale,
                                _dl(out), _dl(lse), activation)
        return out, lse
    return _kmla.prefill_attention(q, k, v, cu_q, cu_k, causal, softmax_scale, out, lse, activation)


# ---- torch custom ops (torch >= 2.4), registered when torch imports ----------------------
try:
    from . import torch_ops  # noqa: F401
except ImportError:  # no torch: NumPy only
    torch_ops = None
