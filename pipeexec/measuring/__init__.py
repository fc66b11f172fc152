"""Measuring inside the workers: the action timer (`recorder`), clocks aligned to rank 0
(`clock`), held-tensor and allocator meters (`memory`), the split-backward probe (`probe`), a
profiled run from start-up to the gathered trace (`session`), zb-auto searched from the run's
own steps (`reschedule`), and the profiling options (`options`, torch-free). Import the modules
themselves: most need torch."""
