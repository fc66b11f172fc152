"""A failed search names the schedules, vpp and precision it held narrow exactly when what it
left out has a plan that fits: each limit here is set between peaks simulated in the test."""
from __future__ import annotations

import dataclasses
import importlib

from pipesim.sim.plan_report import simulate_plan
from pipesim.planner.enumerate import SearchSpace, enumerate_plans, plan_key
from pipesim.planner.hints import fit_hints

# tiny on A100s, every knob but the one under test held to one value
FIXED = dict(model="tiny", hardware="A100", tp=(1,), cp=(1,), mbs=(1,), recompute=("none",))


def peaks(space: SearchSpace) -> dict[str, float]:
    """Each plan of ``space``: its simulated peak (bytes, the worst rank)."""
    return {plan_key(p): max(simulate_plan(p).peak_memory) for p in enumerate_plans(space).plans}


def named(hints: list[str], flag: str) -> list[str]:
    return [h for h in hints if h.startswith(flag + " ")]


def between(low: float, high: float) -> float:
    assert low < high, "the premise fails: what was left out keeps no less memory"
    return (low + high) / 2


def test_a_restricted_schedules_that_fits_nothing_is_named_with_a_plan_that_fits():
    space = SearchSpace(gpus=4, gbs=16, pp=(4,), zero=(0,), schedules=("gpipe",), **FIXED)
    searched = peaks(space)                                  # gpipe holds all 16 microbatches
    others = peaks(dataclasses.replace(space, schedules=("1f1b", "zbv", "interleaved")))
    limit = between(min(others.values()), min(searched.values()))
    hints = fit_hints(space, limit)
    [hint] = named(hints, "--schedules")
    assert "restricted to gpipe" in hint
    key = hint.split(": ", 1)[1].split(" fits")[0]
    assert key.split()[0] != "gpipe"
    assert max(simulate_plan(_plan(space, key)).peak_memory) <= limit
    # below every schedule's peak, widening the schedules fits nothing: not named
    every = dataclasses.replace(space, schedules=("gpipe", "1f1b", "interleaved", "looped-bfs",
                                                  "zb-h1", "zb-h2", "zbv", "dualpipev",
                                                  "v-half", "v-min", "dualpipe"))
    assert not named(fit_hints(space, 0.99 * min(peaks(every).values())), "--schedules")
    assert hints[-1].startswith("more GPUs, or a larger --memory-limit")


def test_a_restricted_vpp_that_fits_nothing_is_named_and_a_wider_one_is_not():
    space = SearchSpace(gpus=2, gbs=8, pp=(2,), zero=(0,), schedules=("interleaved",),
                        vpp=(3, 4), **FIXED)
    searched = peaks(space)
    left_out = peaks(dataclasses.replace(space, vpp=(2, 5, 6, 7, 8)))
    limit = between(min(left_out.values()), min(searched.values()))
    [hint] = named(fit_hints(space, limit), "--vpp")
    assert hint.startswith("--vpp 2,3,4,5,6,7,8 (restricted to 3,4: interleaved")
    key = hint.split(": ", 1)[1].split(" fits")[0]
    assert key in left_out and left_out[key] <= limit
    # the same limit with vpp 2 searched too: that search found the plan, nothing to name
    assert not named(fit_hints(dataclasses.replace(space, vpp=(2, 3, 4)), limit), "--vpp")
    # vpp matters only to the interleaved schedules: restricted beside 1f1b alone, not named
    flat = dataclasses.replace(space, schedules=("1f1b",))
    assert not named(fit_hints(flat, limit), "--vpp")


def test_precision_is_named_when_another_keeps_less_and_fits():
    # ZeRO-1 over dp 4: fp16 keeps 4 + 16/4 bytes a parameter against bf16's 6 + 12/4
    space = SearchSpace(gpus=4, gbs=16, pp=(1,), zero=(1,), **{**FIXED, "recompute": ("full",)})
    bf16 = min(peaks(space).values())
    fp16 = min(peaks(dataclasses.replace(space, precision="fp16")).values())
    fp32 = min(peaks(dataclasses.replace(space, precision="fp32")).values())
    limit = between(fp16, bf16)
    hints = fit_hints(space, limit)
    [hint] = named(hints, "--precision fp16")
    assert "bf16 searched" in hint
    assert bool(named(hints, "--precision fp32")) == (fp32 <= limit)
    assert not named(hints, "--precision fp8")               # fp8 keeps what bf16 keeps
    assert not named(fit_hints(space, 0.99 * min(bf16, fp16, fp32)), "--precision")


def _plan(space: SearchSpace, key: str):
    wide = dataclasses.replace(space, schedules=(key.split()[0],))
    return next(p for p in enumerate_plans(wide).plans if plan_key(p) == key)


def test_a_space_at_its_widest_searches_only_the_other_precisions(monkeypatch):
    """Every schedule and the default vpp searched: the hints search nothing more of them, and
    of the precisions only those keeping fewer bytes of some kind (A100 runs no fp8)."""
    search_module = importlib.import_module("pipesim.planner.search")   # not the function

    calls: list[SearchSpace] = []
    real = search_module.search
    monkeypatch.setattr(search_module, "search",
                        lambda s, **kw: calls.append(s) or real(s, **kw))
    space = SearchSpace(gpus=2, gbs=8, pp=(2,), zero=(0,), **FIXED)
    fit_hints(space, 1.0)
    assert sorted(s.precision for s in calls) == ["fp16", "fp32"]
    assert all(s.schedules == space.schedules and s.vpp is None for s in calls)


def test_pipesim_plan_names_the_restricted_schedules_when_nothing_fits(capsys):
    from pipesim.cli import main

    space = SearchSpace(gpus=4, gbs=16, pp=(4,), zero=(0,), schedules=("gpipe",), **FIXED)
    limit = between(min(peaks(dataclasses.replace(space, schedules=("1f1b",))).values()),
                    min(peaks(space).values()))
    code = main(["plan", "--model", "tiny", "--hardware", "A100", "--gpus", "4", "--gbs", "16",
                 "--schedules", "gpipe", "--pp", "4", "--tp", "1", "--cp", "1", "--mbs", "1",
                 "--recompute", "none", "--zero", "0", "--memory-limit", f"{limit:.0f}B",
                 "--workers", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "nothing fits" in err
    hints = err.split("what would search plans keeping less memory:\n")[1].splitlines()
    [hint] = named([h.strip() for h in hints], "--schedules")
    assert "(restricted to gpipe: " in hint and " fits, peak " in hint
