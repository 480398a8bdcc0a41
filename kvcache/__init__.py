"""UltraQuant (arXiv 2606.20474): FP4 KV cache, paged split-KV and unified attention kernels, capacity planning,
and a serving engine with prefix caching.

    from kvcache import formats, PagedPool, decode_attention, unified_attention
    fmt = formats.get("fp4")                       # or "bf16", "fp8"; fp4 takes scale_rule="mse" | "mx"
    pool = PagedPool.create(fmt, num_layers=L, num_kv_heads=K, head_dim=D, memory_bytes=2**30)
"""

from kvcache import capacity, formats
from kvcache.attention import IMPLEMENTATIONS, decode_attention, unified_attention, write
from kvcache.blocks import BlockManager
from kvcache.engine import Engine, EngineConfig
from kvcache.paged import PagedKVCache, PagedPool, paged_cache_factory

__all__ = [
    "IMPLEMENTATIONS",
    "BlockManager",
    "Engine",
    "EngineConfig",
    "PagedKVCache",
    "PagedPool",
    "capacity",
    "decode_attention",
    "formats",
    "paged_cache_factory",
    "unified_attention",
    "write",
]
