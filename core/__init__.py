"""Bottom layer every kvmesh folder may import: config, typed errors, seams, telemetry names."""
