"""UltraQuant (arXiv 2606.20474): FP4 KV cache, paged split-KV and unified attention kernels, capacity planning
(the KV library), and a serving runtime with prefix caching (`kvcache.serving`, the one home of `Engine`,
`EngineConfig`, ...). docs/kvcache.md.

    from kvcache import formats, PagedPool, decode_attention, unified_attention
    fmt = formats.get("fp4")                       # or "bf16", "fp8", "nvfp4", "k8v4" (formats.get documents
                                                   # each one's options: grid=, scale_rule=, select=, ...)
    pool = PagedPool.create(fmt, num_layers=L, num_kv_heads=K, head_dim=D, memory_bytes=2**30)
"""

from kvcache import capacity, formats, serving
from kvcache.attention import IMPLEMENTATIONS, decode_attention, unified_attention, write
from kvcache.paged import PagedKVCache, PagedPool, paged_cache_factory

__all__ = [
    "IMPLEMENTATIONS",
    "PagedKVCache",
    "PagedPool",
    "capacity",
    "decode_attention",
    "formats",
    "paged_cache_factory",
    "serving",
    "unified_attention",
    "write",
]
