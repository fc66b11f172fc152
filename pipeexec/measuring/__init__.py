"""Measuring, inside the workers: the action timer (`recorder`), clocks aligned to rank 0
(`clock`), held-tensor and allocator meters (`memory`), the split-backward probe (`probe`), a
profiled run from start-up to the gathered trace (`session`), zb-auto searched from the run's
own steps (`reschedule`), the profiling options (`profile_options`, torch-free); and of the
machine itself: the gloo collectives (`collectives`) and the figures ``pipeexec
calibrate-hardware`` writes (`calibrate_hardware`). Import the modules
themselves: most need torch."""
