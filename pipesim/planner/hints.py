"""What would have made something fit: every knob a search held narrower than its widest.

Why: a search that finds nothing should name the flags that widen it (once: no
plan for Llama 3 405B on 16384 H100s, and the hint never said ``--uneven``), not a fixed
list. Each knob of the :class:`~pipesim.planner.enumerate.SearchSpace` whose values leave out
a memory-saving choice is named with the flag that adds it. The schedules, vpp and precision
save memory in no fixed direction (a schedule holds its own number of microbatches, fp32 keeps
fewer optimizer bytes but twice the activations), so those are named only when a search of
what was left out finds a plan that fits, which the hint then names. Then the cluster and the
limit.
"""
from __future__ import annotations

import dataclasses

from ..plan.footprint import ACTIVATION_BYTES, BYTES_PER_PARAM
from ..plan.parallelism import PRECISIONS
from .enumerate import ALL_SCHEDULES, DEFAULT_VPPS, VPP_MANY, SearchSpace
from ..units import GiB


def fit_hints(space: SearchSpace, memory_limit: float | None = None, *,
              workers: int | None = 1) -> list[str]:
    """Flags that would search plans keeping less memory, each with what it adds.

    ``memory_limit`` (bytes; default the hardware's usable memory) is the failed search's: the
    schedules, vpp and precision left out are searched under it (``workers`` as in
    :func:`~pipesim.planner.search`), and named only when one of their plans fits.
    """
    limit = float(space.hardware.usable_memory if memory_limit is None else memory_limit)
    return [*narrowed_hints(space), *left_out_hints(space, limit, workers),
            "more GPUs, or a larger --memory-limit (the default is the GPU's usable memory: "
            "its capacity less the reserve, over the fragmentation factor)"]


def narrowed_hints(space: SearchSpace) -> list[str]:
    """The knobs whose left-out values always keep less memory, or may (a restriction); no
    search is run."""
    out: list[str] = []
    if 3 not in space.values("zero"):
        out.append("--zero 0,1,2,3 (shard gradients and weights too: ZeRO-2/3)")
    if space.grad_reduce == "per_step" and any(z >= 2 for z in space.values("zero")):
        out.append("--grad-reduce per_microbatch (ZeRO-2/3 keep only their gradients' shard, "
                   "reduced inside every backward: m times the reduce-scatters)")
    if space.precision != "fp32" and space.grad_reduce_in_fp32 is not False:
        out.append("--no-grad-reduce-in-fp32 (16-bit gradients: half their bytes)")
    if "full" not in space.recompute:
        out.append("--recompute full (keep only each layer's input)")
    if 1 not in space.values("mbs"):
        out.append("--mbs 1 (the smallest micro batch)")
    if not space.uneven:
        out.append("--uneven (near-even stages where layers do not divide pp * vpp)")
    if space.sequence_parallel is False:
        out.append("--sequence-parallel (split the norms and dropout over tp)")
    if not space.tp_across_nodes and space.gpus > space.cluster.domain:
        out.append("--tp-across-nodes (tp beyond one NVLink domain)")
    for knob, flag in (("tp", "--tp"), ("cp", "--cp"), ("pp", "--pp"), ("ep", "--ep"),
                       ("dp", "--dp"), ("microbatches", "--microbatches")):
        given = getattr(space, knob)
        if given is not None:
            out.append(f"{flag} (restricted to {','.join(map(str, given))}: drop it or widen it)")
    return out


def left_out_hints(space: SearchSpace, limit: float, workers: int | None = 1) -> list[str]:
    """The schedules, vpp and precisions left out, each named when its search under ``limit``
    (bytes) finds a plan that fits: a search each, so only for a search that found none."""
    out = []
    for flag, widened, said in _left_out(space):
        found = _fitting(widened, limit, workers)
        if found is not None:
            out.append(f"{flag} ({said}: {found})")
    return out


def _left_out(space: SearchSpace) -> list[tuple[str, SearchSpace, str]]:
    """(flag, the space of only what the search left out of that knob, what was searched)."""
    out = []
    others = tuple(s for s in ALL_SCHEDULES if s not in space.schedules)
    if others:
        out.append((f"--schedules {','.join(ALL_SCHEDULES)}",
                    dataclasses.replace(space, schedules=others),
                    f"restricted to {','.join(space.schedules)}"))
    many = tuple(s for s in space.schedules if s in VPP_MANY)
    more = tuple(v for v in DEFAULT_VPPS if v not in space.values("vpp"))
    if space.vpp is not None and many and more:
        out.append((f"--vpp {','.join(map(str, sorted({*space.vpp, *DEFAULT_VPPS})))}",
                    dataclasses.replace(space, schedules=many, vpp=more),
                    f"restricted to {','.join(map(str, space.vpp))}"))
    for precision in _precisions_keeping_less(space):
        out.append((f"--precision {precision}", dataclasses.replace(space, precision=precision),
                    f"{space.precision} searched"))
    return out


def _precisions_keeping_less(space: SearchSpace) -> list[str]:
    """Precisions that keep fewer bytes of some kind than the searched one (fp8 keeps bf16's,
    so it never fits what bf16 does not) and that the hardware runs."""
    now = (*BYTES_PER_PARAM[space.precision], ACTIVATION_BYTES[space.precision])
    out = []
    for p in PRECISIONS:
        bytes_ = (*BYTES_PER_PARAM[p], ACTIVATION_BYTES[p])
        if space.hardware.precision_refusal(p):
            continue
        if any(b < n for b, n in zip(bytes_, now)):
            out.append(p)
    return out


def _fitting(space: SearchSpace, limit: float, workers: int | None) -> str | None:
    """The best plan of ``space`` that fits ``limit``, described; None when none does."""
    from .search import search

    result = search(space, memory_limit=limit, top=1, workers=workers)
    ranked = result.ranked
    if not len(ranked):
        return None
    row = ranked.iloc[0]
    return (f"{row['key']} fits, peak {row['peak_memory'] / GiB:.2f} GiB of the "
            f"{limit / GiB:.2f} GiB limit, {row['step_time']:.4g} s a step")
