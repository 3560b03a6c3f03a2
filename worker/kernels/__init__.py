"""Compute kernels: the CPU C sources and their builds, the native CPU step, Triton ops, torch references, and the dispatch between them."""
