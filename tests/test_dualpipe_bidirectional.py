"""Routes and tied copies in the IR, and the bidirectional dualpipe builder (DeepSeek's DualPipe)."""
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import pipesim
from pipesim.sim.calibrate import fit_costs
from pipesim import Action, CostModel, Schedule, ScheduleError, simulate
from pipesim.schedule.action import Overlap
from pipesim.schedule.channels import check_channels, one_way_pairs
from pipesim.schedule.io import schedule_from_json, schedule_to_csv, schedule_to_json

even_pp = st.integers(1, 6).map(lambda h: 2 * h)


def reference_dualpipe(rank, pp, m):
    """DeepSeek's DualPipe.step (github.com/deepseek-ai/DualPipe, dualpipe/dualpipe.py), its
    eight steps transcribed with the compute calls recorded instead of run. The reference names
    a computation by its phase after ``phase ^= is_in_second_half`` (0: the forward direction,
    fed at rank 0; 1: the reverse direction, fed at rank pp-1) and a per-phase chunk counter;
    ``_backward_chunk(enable_zb=True)`` runs the input gradient and queues the weight gradient
    (WeightGradStore, FIFO), ``_weight_chunk`` pops the oldest. Returned as (op, phase, chunk),
    an overlap as ("FB", (phase0, chunk0), (phase1, chunk1))."""
    num_half_ranks, half_rank = pp // 2, min(rank, pp - 1 - rank)
    half_num_chunks = m // 2
    second = rank >= num_half_ranks
    is_middle = rank in (num_half_ranks - 1, num_half_ranks)
    f_id, b_id, queue, out = [0, 0], [0, 0], [], []

    def fwd(phase):
        phase ^= second
        f_id[phase] += 1
        return ("F", phase, f_id[phase] - 1)

    def bwd(phase, zb=False):
        phase ^= second
        b_id[phase] += 1
        if zb:
            queue.append((phase, b_id[phase] - 1))
        return ("I" if zb else "B", phase, b_id[phase] - 1)

    def weight():
        out.append(("W",) + queue.pop(0))

    def fb(p0, p1):
        a, b = fwd(p0), bwd(p1)
        out.append(("FB", a, b))

    for _ in range((num_half_ranks - half_rank - 1) * 2):      # Step 1: nF0
        out.append(fwd(0))
    for _ in range(half_rank + 1):                             # Step 2: nF0F1
        out.append(fwd(0))
        out.append(fwd(1))
    for _ in range(num_half_ranks - half_rank - 1):            # Step 3: nB1W1F1 (zero bubble)
        out.append(bwd(1, zb=True))
        weight()
        out.append(fwd(1))
    for i in range(half_num_chunks - pp + half_rank + 1):      # Step 4: nF0B1F1B0
        if i == 0 and is_middle:                               # not overlapped: less bubble
            out.append(fwd(0))
            out.append(bwd(1))
        else:
            fb(0, 1)
        fb(1, 0)
    for _ in range(num_half_ranks - half_rank - 1):            # Step 5: nB1F1B0
        out.append(bwd(1))
        fb(1, 0)
    step_6, zb = half_rank + 1, False                          # Step 6: nB1B0, 2nd half ZB
    for i in range(step_6):
        if i == step_6 // 2 and half_rank % 2 == 1:
            zb = True
        out.append(bwd(1, zb))
        if i == step_6 // 2 and half_rank % 2 == 0:
            zb = True
        out.append(bwd(0, zb))
    for _ in range(num_half_ranks - half_rank - 1):            # Step 7: nWB0 (zero bubble)
        weight()
        out.append(bwd(0, zb=True))
    for _ in range(half_rank + 1):                             # Step 8: nW
        weight()
    assert not queue and f_id == [half_num_chunks] * 2 == b_id
    return out


def as_actions(ref, rank, pp, m):
    """The reference's (op, phase, chunk) in our names: the forward direction's chunk k is
    microbatch k on stage ``rank``; the reverse direction's is microbatch m/2 + k on the copy
    stage 2pp-1-rank (the placement of the dualpipe builder's docstring)."""
    def one(op, phase, chunk):
        if phase == 0:
            return Action(op, rank, chunk)
        return Action(op, 2 * pp - 1 - rank, m // 2 + chunk)
    return [Overlap(one(*a[1]), one(*a[2])) if a[0] == "FB" else one(*a) for a in ref]


@pytest.mark.parametrize("pp", [2, 4, 6, 8])
def test_dualpipe_is_deepseeks_order(pp):
    for m in range(2 * pp, 2 * pp + 9, 2):
        s = pipesim.build_schedule("dualpipe", pp=pp, microbatches=m).validate()
        for r in range(pp):
            theirs = as_actions(reference_dualpipe(r, pp, m), r, pp, m)
            assert [str(a) for a in s.compute_order(r)] == [str(a) for a in theirs], (pp, m, r)


def test_dualpipe_pp4_m8_rank0_written_out():
    """pp 4, m 8, rank 0, read off the reference by hand: 2 F of the forward direction (step 1),
    F0 F1 (step 2: 0F2 then the reverse direction's first microbatch 4 on copy stage 7), the
    zero-bubble turn I W F (step 3), then the overlapped steady state."""
    s = pipesim.build_schedule("dualpipe", pp=4, microbatches=8)
    assert [str(a) for a in s.compute_order(0)[:9]] == [
        "0F0", "0F1", "0F2", "7F4", "7I4", "7W4", "7F5",
        "(0F3;7B5)OVERLAP_F_B", "(7F6;0B0)OVERLAP_F_B"]


def test_dualpipe_shape():
    pp, m = 4, 8
    s = pipesim.build_schedule("dualpipe", pp=pp, microbatches=m)
    assert (s.pp, s.vpp, s.num_stages, s.num_parts) == (4, 2, 8, 4)
    assert s.placement == (0, 1, 2, 3, 3, 2, 1, 0)             # the V placement
    assert [s.stage_part(x) for x in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [list(s.route(mb)) for mb in (0, 3, 4, 7)] == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2
    # rank r holds part r (forward direction) and a copy of part pp-1-r (reverse direction)
    for r in range(pp):
        assert sorted(s.stage_part(x) for x in s.rank_stages(r)) == sorted({r, pp - 1 - r}) * (
            1 if r != pp - 1 - r else 2)


@pytest.mark.parametrize("kw, words", [
    (dict(pp=3, microbatches=6), "even pp"),
    (dict(pp=4, microbatches=9), "even number of microbatches >= 2\\*pp = 8"),
    (dict(pp=4, microbatches=6), "even number of microbatches >= 2\\*pp = 8"),
    (dict(pp=4, microbatches=8, vpp=2), "dualpipe needs vpp == 1"),
])
def test_dualpipe_constraints_in_words(kw, words):
    with pytest.raises(ScheduleError, match=words):
        pipesim.build_schedule("dualpipe", **kw)


# -- DualPipe README: bubble, parameters and activations ---------------------------------------
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pp=even_pp, extra=st.integers(0, 4), fwd=st.floats(0.5, 2.0),
       w_share=st.floats(0.1, 1.0), factor=st.floats(0.7, 1.0))
def test_dualpipe_bubble_and_memory_as_the_dualpipe_readme(pp, extra, fwd, w_share, factor):
    """github.com/deepseek-ai/DualPipe README, "Pipeline Bubbles and Memory Usage Comparison":

        | Method    | Bubble                  | Parameter | Activation | #Devices |
        | 1F1B      | (PP-1)(F+B)             | 1x        | PP         | PP       |
        | DualPipe  | (PP/2-1)(F&B+B-3W)      | 2x        | PP+1       | PP       |

    PP ranks, the model cut in PP parts; F, B, W: one part's forward, full backward and weight
    backward; F&B an overlapped pair. Exact for the worst rank when a part's input backward costs
    what its forward does and W <= I (as for DualPipeV; the simulator, zero communication)."""
    m = 2 * pp + 2 * extra
    inp, w = fwd, w_share * fwd
    b = inp + w
    s = pipesim.build_schedule("dualpipe", pp=pp, microbatches=m)
    costs = CostModel(forward=fwd, backward_input=inp, backward_weight=w, overlap_factor=factor,
                      activation_bytes=1.0)
    r = simulate(s, costs)
    tr = r.trace[r.trace["kind"] == "compute"]
    busy = (tr["end"] - tr["start"]).groupby(tr["rank"]).sum()
    f_and_b = factor * (fwd + b)
    assert max(r.makespan - busy) == pytest.approx((pp / 2 - 1) * (f_and_b + b - 3 * w), abs=1e-9)
    assert max(r.peak_memory) == pp + 1                        # PP + 1 part activations
    # parameters: 2x those of 1F1B on the same PP parts (stage_static_bytes: a part's weights)
    params = CostModel(forward=fwd, stage_static_bytes=10.0)
    one = simulate(pipesim.build_schedule("1f1b", pp=pp, microbatches=m), params)
    two = simulate(s, params)
    assert min(two.peak_memory) == max(two.peak_memory) == 2 * max(one.peak_memory) == 20.0


def test_per_part_costs_spread_onto_the_copies():
    """Costs given per model part (one value per part) are the costs of every stage computing
    the part: stage pp+j costs what part j costs."""
    pp, m = 4, 8
    s = pipesim.build_schedule("dualpipe", pp=pp, microbatches=m)
    part_fwd = [1.0, 2.0, 3.0, 4.0]
    r = simulate(s, CostModel(forward=part_fwd, activation_bytes=[1, 10, 100, 1000]))
    tr = r.trace[(r.trace["kind"] == "compute") & (r.trace["op"] == "F")]
    for stage, dur in zip(tr["stage"], tr["end"] - tr["start"]):
        assert dur == pytest.approx(part_fwd[stage % pp])
    assert r.costs.activation_bytes[4:] == (1, 10, 100, 1000)
    with pytest.raises(ValueError, match="3 per-stage values, expected num_stages = 8"):
        simulate(s, CostModel(forward=[1.0, 2.0, 3.0]))


# -- the IR: routes and copies -----------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(pp=even_pp, extra=st.integers(0, 6), lookahead=st.integers(0, 3))
def test_dualpipe_comms_files_and_channels(pp, extra, lookahead):
    m = 2 * pp + 2 * extra
    s = pipesim.build_schedule("dualpipe", pp=pp, microbatches=m, recv_lookahead=lookahead)
    s.validate()
    sends = [a for r in range(pp) for a in s.actions(r) if a.op == "SEND_F"]
    grads = [a for r in range(pp) for a in s.actions(r) if a.op == "SEND_B"]
    # every microbatch crosses pp-1 rank boundaries each way, never the meeting of the routes
    assert len(sends) == len(grads) == m * (pp - 1)
    assert all(a.stage != s.last_stage(a.microbatch) for a in sends)
    assert all(a.stage != s.first_stage(a.microbatch) for a in grads)
    back = schedule_from_json(schedule_to_json(s))
    assert back == s and back.routes == s.routes and back.stage_parts == s.stage_parts
    check_channels(s, one_way_pairs)                           # pipeexec's channels (NCCL)


def test_csv_refuses_routes_with_the_reason():
    s = pipesim.build_schedule("dualpipe", pp=2, microbatches=4)
    with pytest.raises(ScheduleError, match="take different routes.*schedule_to_json"):
        schedule_to_csv(s)


def _two_way(pp, m, orders=None):
    """A hand-made bidirectional GPipe on 2 stages per rank (V placement): microbatches 0..m/2-1
    down stages 0..pp-1, the rest up the copies pp..2pp-1."""
    routes = [(0, pp - 1)] * (m // 2) + [(pp, 2 * pp - 1)] * (m - m // 2)
    parts = [s % pp for s in range(2 * pp)]
    if orders is None:
        place = pipesim.schedule.placement.vshape(pp, 2)
        orders = [[] for _ in range(pp)]
        for mb, (first, last) in enumerate(routes):
            for st_ in range(first, last + 1):
                orders[place[st_]].append(Action("F", st_, mb))
        for mb, (first, last) in enumerate(routes):
            for st_ in range(last, first - 1, -1):
                orders[place[st_]].append(Action("B", st_, mb))
    return Schedule(pp, 2, m, "v", orders, routes=routes, stage_parts=parts)


@settings(max_examples=25, deadline=None)
@given(pp=st.integers(1, 6), m=st.integers(2, 12))
def test_hand_made_routes_validate_and_simulate(pp, m):
    """A route-per-microbatch GPipe: every microbatch's route is the whole model, so every
    rank runs each microbatch once (one stage of its route there): m F and m B, 3m units of
    work with F = 1, B = 2. (The simulated timing of routed schedules is checked against an
    independent list scheduler in tests/test_sim_engine.py, dualpipe among the builders.)"""
    s = _two_way(pp, m).validate()
    r = simulate(s, CostModel(forward=1.0, backward=2.0))
    tr = r.trace[r.trace["kind"] == "compute"]
    busy = (tr["end"] - tr["start"]).groupby(tr["rank"]).sum()
    assert busy.tolist() == [3.0 * m] * pp and r.makespan >= 3 * m
    if pp == 1:                   # both routes on one rank: no wait at all
        assert r.makespan == 3 * m
    assert schedule_from_json(schedule_to_json(s)) == s


def test_routed_deadlock_names_the_ranks():
    """Rank 0 starts with microbatch 1's forward on copy stage 3, which needs stage 2 (rank
    1), while rank 1 starts with microbatch 0's forward on stage 1, which needs stage 0
    (rank 0): neither can move."""
    pp, m = 2, 2
    orders = [[Action("F", 3, 1), Action("F", 0, 0), Action("B", 0, 0), Action("B", 3, 1)],
              [Action("F", 1, 0), Action("F", 2, 1), Action("B", 2, 1), Action("B", 1, 0)]]
    with pytest.raises(ScheduleError, match="deadlock: rank 0 is stuck at 3RECV_F1 .*; rank 1 "
                                            "is stuck at 1RECV_F0"):
        _two_way(pp, m, orders).validate()


def test_show_prints_routes_and_copies(capsys):
    from pipesim.cli import main

    assert main(["show", "dualpipe", "--pp", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert "routes: microbatches 0-3 through stages 0..3; microbatches 4-7 through stages 4..7" in out
    assert "copies (tied weights): s4=part 0, s5=part 1, s6=part 2, s7=part 3" in out
    # simulate names the vpp the user gave (model parts a rank), and the stages it holds
    assert main(["simulate", "dualpipe", "--pp", "4", "-m", "8"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head.startswith("dualpipe: pp=4 vpp=1 (2 stages a rank: its part and a copy of "
                           "another) microbatches=8"), head


def test_route_errors_name_the_microbatch():
    pp, m = 2, 2
    good = _two_way(pp, m)
    orders = [good.compute_order(r) for r in range(pp)]
    # a forward of microbatch 0 on a stage off its route (stage 3 is a copy stage, route 2..3 is mb 1's)
    bad = [list(o) for o in orders]
    bad[0].insert(0, Action("F", 3, 0))
    with pytest.raises(ScheduleError, match="rank 0: action 3F0 runs stage 3, which is not on "
                                            "microbatch 0's route \\(stages 0..1\\)"):
        _two_way(pp, m, bad).validate()
    bad = [[a for a in o if str(a) not in ("2F1", "2B1")] for o in orders]
    with pytest.raises(ScheduleError, match="forward 2F1 is missing"):
        _two_way(pp, m, bad).validate()
    # hand-made comms across the meeting of the routes
    full = [good.actions(r) for r in range(pp)]
    full[1].insert(full[1].index(Action("F", 1, 0)) + 1, Action("SEND_F", 1, 0))
    with pytest.raises(ScheduleError, match="1SEND_F0 has no peer stage 2 \\(microbatch 0: its "
                                            "route ends at stage 1\\)"):
        _two_way(pp, m, full).validate()


def test_route_and_part_construction_errors():
    orders = [[], []]
    with pytest.raises(ScheduleError, match="got 1 routes, expected one per microbatch \\(2\\)"):
        Schedule(2, 2, 2, "v", orders, routes=[(0, 1)])
    with pytest.raises(ScheduleError, match="microbatch 1's route \\[3, 1\\] is not a contiguous"):
        Schedule(2, 2, 2, "v", orders, routes=[(0, 1), (3, 1)])
    with pytest.raises(ScheduleError, match="leaves the stages 0..3"):
        Schedule(2, 2, 2, "v", orders, routes=[(0, 1), (2, 4)])
    with pytest.raises(ScheduleError, match="skips model layers; give stage_parts"):
        Schedule(2, 2, 2, "v", orders, routes=[(0, 1), (2, 3)])
    with pytest.raises(ScheduleError, match="microbatch 1's route \\(stages 2..3\\) computes parts "
                                            "\\[1, 0\\], expected the whole model in order"):
        Schedule(2, 2, 2, "v", orders, routes=[(0, 1), (2, 3)], stage_parts=[0, 1, 1, 0])
    # full routes are the default and compare equal to it
    a = Schedule(2, 1, 2, "looped", orders, routes=[range(0, 2)] * 2)
    assert a.routes is None and a.stage_parts is None and a.num_parts == 2


def test_json_route_error_names_the_file(tmp_path):
    data = json.loads(schedule_to_json(pipesim.build_schedule("dualpipe", pp=2, microbatches=4)))
    data["routes"][0] = [0, 3]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ScheduleError, match=f"{path}: stage_parts: microbatch 0's route"):
        schedule_from_json(path)


# -- plans and the planner -----------------------------------------------------------------
def test_dualpipe_plan_counts_two_parameter_copies():
    """A dualpipe plan cuts the model into pp parts (vpp 1) and each rank holds part r and a
    copy of part pp-1-r: weights, gradients and optimizer state are those of 1F1B's ranks r
    and pp-1-r added, and the copies' gradients are summed over the pair after the backward."""
    kw = dict(pp=4, global_batch_size=16, micro_batch_size=1)
    one = pipesim.Plan.create("gpt3-1.3b", "H100", schedule="1f1b", **kw)
    two = pipesim.Plan.create("gpt3-1.3b", "H100", schedule="dualpipe", **kw)
    r1, r2 = simulate(one), simulate(two)
    assert two.build_schedule().has_copies
    for r in range(4):
        for k in ("weights", "gradients", "optimizer"):
            want = r1.memory_breakdown[r][k] + r1.memory_breakdown[3 - r][k]
            assert r2.memory_breakdown[r][k] == pytest.approx(want, rel=1e-12), (r, k)
        assert r2.derived.tail[r].tied_comm > 0
    assert r2.peak_memory[0] == r2.peak_memory[3] and r2.bubble_fraction < r1.bubble_fraction
    with pytest.raises(pipesim.PlanError, match="dualpipe needs an even pp"):
        pipesim.Plan.create("gpt3-1.3b", "H100", schedule="dualpipe", pp=3,
                            global_batch_size=12).validate()
    with pytest.raises(pipesim.PlanError, match="dualpipe needs vpp == 1"):
        pipesim.Plan.create("gpt3-1.3b", "H100", schedule="dualpipe", vpp=2,
                            **kw).validate()
    # a plan holding the dualpipe schedule as data: its vpp is the parts per rank (1)
    as_data = pipesim.Plan.create("gpt3-1.3b", "H100", schedule=two.build_schedule(), **kw)
    assert simulate(as_data).step_time == pytest.approx(r2.step_time)
    back = pipesim.Plan.from_json(as_data.to_json())
    assert back.build_schedule().routes == two.build_schedule().routes


def test_planner_searches_dualpipe_and_refuses_it_in_words():
    from pipesim.planner import SearchSpace, enumerate_plans

    space = SearchSpace(model="tiny", gpus=8, gbs=16, hardware="A100", schedules=("dualpipe",),
                        mbs=(1, 2, 4), recompute=("none",), zero=(0,), tp=(1,), cp=(1,))
    enum = enumerate_plans(space)
    assert enum.plans and all(p.parallelism.pp % 2 == 0 for p in enum.plans)
    for plan in enum.plans:
        plan.validate()
        m = plan.parallelism.microbatches
        assert m % 2 == 0 and m >= 2 * plan.parallelism.pp
    assert any("dualpipe needs an even pp" in reason for reason in enum.refused)


@pytest.mark.parametrize("schedule,vpp", [("dualpipe", 1), ("dualpipev", 2), ("1f1b", 1)])
@pytest.mark.parametrize("pp,gbs", [(2, 8), (4, 16), (4, 24)])
def test_planner_bounds_stay_below_the_simulation(schedule, vpp, pp, gbs):
    """pipesim.planner.bounds: sound lower bounds (the planner prunes on them), also when
    stages are copies sharing the microbatches and when actions are overlapped F&B pairs."""
    from pipesim.planner.bounds import plan_bounds

    plan = pipesim.Plan.create("gpt3-1.3b", "H100", schedule=schedule, pp=pp, vpp=vpp,
                               global_batch_size=gbs, micro_batch_size=1)
    result = simulate(plan)
    bounds = plan_bounds(plan)
    assert bounds.step_time <= result.step_time * (1 + 1e-9)
    assert bounds.memory <= max(result.peak_memory) * (1 + 1e-9)
    # the bound's busy time is the simulated compute of the busiest rank
    tr = result.sim.trace[result.sim.trace["kind"] == "compute"]
    busiest = (tr["end"] - tr["start"]).groupby(tr["rank"]).sum().max()
    assert bounds.compute_time == pytest.approx(busiest, rel=1e-9)


# -- calibration: a measured dualpipe run fits per-part costs ---------------------------------
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_fit_costs_pools_the_copies_of_a_part(pp, m):
    """A trace of dualpipe fitted with the schedule's stage_parts gives every copy its part's
    costs, which it is simulated with: fitting the simulator's own trace returns the costs it
    ran (per part), also where a part runs only full backwards (pp 2: part 1 never runs I, so
    its I and W are an even split of B, which is what these costs are)."""
    s = pipesim.build_schedule("dualpipe", pp=pp, microbatches=m)
    part_f = [1.0 + p for p in range(pp)]
    costs = CostModel(forward=part_f, backward_input=part_f, backward_weight=part_f)
    r = simulate(s, costs)
    fitted = fit_costs(r.trace, num_stages=s.num_stages, stage_parts=s.stage_parts)
    want = [part_f[s.stage_part(x)] for x in range(s.num_stages)]
    assert list(fitted.forward) == pytest.approx(want)
    assert list(fitted.backward_input) == pytest.approx(want)
    assert list(fitted.backward_weight) == pytest.approx(want)
    if pp == 2:   # without the pooling, a copy stage lacks I: refused with the stage named
        with pytest.raises(ValueError, match="I is measured on some stages but not on stage"):
            fit_costs(r.trace, num_stages=s.num_stages)


def test_run_plan_layout_gives_each_copy_its_parts_layers():
    from pipeexec.analysis.run_plan import RunPlan

    s = pipesim.build_schedule("dualpipe", pp=2, microbatches=4)
    plan = RunPlan(s, (0, 2, 5), ("embedding", "block", "block", "block", "head"))
    counts = plan.layout.counts(["embedding", "block", "head"])
    assert counts.tolist() == [[1, 1, 0], [0, 2, 1], [1, 1, 0], [0, 2, 1]]   # stages 0..3
    with pytest.raises(ValueError, match="give 3 stages, the schedule 'dualpipe' has 2 model parts"):
        RunPlan(s, (0, 1, 2, 5), ("block",) * 5)
    meta = plan.to_meta()                  # the run's vpp (parts per rank), as its config says
    assert meta["vpp"] == plan.parts_per_rank == 1
    back = RunPlan.from_meta(meta)
    assert back.schedule == s and back.layout == plan.layout
