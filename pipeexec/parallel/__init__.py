"""Parallelism inside a pipeline stage: the device mesh and its groups' layout (`mesh`),
tensor and sequence parallelism (`regions`, `layers`, `sharding`)."""
