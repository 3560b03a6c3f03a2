"""Tensor parallelism: process groups and collectives, sharded layers, the TP group of Ray actors."""
