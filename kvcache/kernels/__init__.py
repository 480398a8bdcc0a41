"""Pallas kernels of the paged KV cache: attention (split-KV decode, unified prefill + decode) and quantise-on-write."""

__all__ = ["attention", "write"]
