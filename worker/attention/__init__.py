"""Attention backends over the paged KV cache: the seam, the torch reference, the CPU fast path, Triton."""
