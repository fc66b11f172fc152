"""What would have made something fit: every knob a search held narrower than its widest.

Why: a search that finds nothing should name the flags that widen it (the issue's case: no
plan for Llama 3 405B on 16384 H100s, and the hint never said ``--uneven``), not a fixed
list. Each knob of the :class:`~pipesim.planner.enumerate.SearchSpace` whose values leave out
a memory-saving choice is named with the flag that adds it; then the cluster and the limit.
"""
from __future__ import annotations

from .enumerate import SearchSpace


def fit_hints(space: SearchSpace) -> list[str]:
    """Flags that would search plans keeping less memory, each with what it adds."""
    out: list[str] = []
    if 3 not in space.values("zero"):
        out.append("--zero 0,1,2,3 (shard gradients and weights too: ZeRO-2/3)")
    if "full" not in space.recompute:
        out.append("--recompute full (keep only each layer's input)")
    if 1 not in space.values("mbs"):
        out.append("--mbs 1 (the smallest micro batch)")
    if not space.uneven:
        out.append("--uneven (near-even stages where layers do not divide pp * vpp)")
    if space.sequence_parallel is False:
        out.append("--sequence-parallel (split the norms and dropout over tp)")
    if not space.tp_across_nodes:
        out.append("--tp-across-nodes (tp beyond one NVLink domain)")
    for knob, flag in (("tp", "--tp"), ("cp", "--cp"), ("pp", "--pp"), ("ep", "--ep"),
                       ("dp", "--dp"), ("microbatches", "--microbatches")):
        given = getattr(space, knob)
        if given is not None:
            out.append(f"{flag} (restricted to {','.join(map(str, given))}: drop it or widen it)")
    out.append("more GPUs, or a larger --memory-limit (the default is the GPU's usable memory: "
               "its capacity less the reserve, over the fragmentation factor)")
    return out
