"""The model and what runs it: layers, attention, kernels, loader, runner, sampler."""
