"""The engine loop: requests, admission, scheduling, engine assembly, outputs."""
