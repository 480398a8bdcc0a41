"""UltraQuant (arXiv 2606.20474): FP4 KV cache, paged split-KV and unified attention kernels, serving."""
