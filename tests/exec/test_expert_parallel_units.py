"""Expert parallelism's pieces in one process: the NCCL channel model covers its all-to-alls,
and the layer's bookkeeping (ownership, refusals).

ep's all-to-alls are collectives inside F and B (and the backward's I), as tp's are, on the ep
group's own communicators (`pipeexec.topology`), apart from every p2p channel. Every rank of an
ep group is in one dp x cp group at one pipeline position (`Mesh`'s expert layout), so it runs
the same pipeline rank's actions in the same order: the model of
`pipesim.schedule.channels` (``collective_of=group_collectives``, what `check_p2p_order`
checks with ``collectives=True``, which the Trainer asks for when ep > 1) applies as it is.
"""
from __future__ import annotations

import pytest

import pipesim
from pipeexec.parallel.mesh import Mesh
from pipeexec.pipeline.p2p import check_p2p_order

from exec_helpers import choose_microbatches, choose_vpp


def test_ep_groups_sit_at_one_pipeline_position():
    """What the channel model needs of a collective's group: its members run one program."""
    for mesh in (Mesh(dp=2, pp=2, ep=2), Mesh(tp=2, dp=2, pp=2, ep=2), Mesh(dp=2, cp=2, pp=2, ep=4)):
        for group in mesh.ep_groups() + mesh.edp_groups():
            assert len({mesh.coords(r).pp for r in group}) == 1, (mesh, group)
            assert len({mesh.coords(r).tp for r in group}) == 1, (mesh, group)


def test_channel_model_accepts_ep_collectives_for_every_builder_at_pp2():
    checked = set()
    for name in pipesim.schedule_names():
        m = choose_microbatches(name, 2, 2)
        if m is None:
            continue
        schedule = pipesim.build_schedule(name, pp=2, microbatches=m,
                                          vpp=choose_vpp(name, 2, m)).validate()
        check_p2p_order(schedule, collectives=True)
        checked.add(name)
    assert checked == set(pipesim.schedule_names())


def test_local_experts_and_their_refusal():
    from pipeexec.parallel.experts import ExpertParallel, local_experts
    assert local_experts(8, ExpertParallel(None, 4, 3)) == range(6, 8)
    with pytest.raises(ValueError, match="6 experts do not divide over ep = 4"):
        local_experts(6, ExpertParallel(None, 4, 0))


def test_a_plan_priced_with_deepep_or_the_a2a_overlap_is_refused_naming_the_field():
    """pipesim prices Megatron's flex dispatchers and its EP all-to-all overlap for planning;
    the executor runs torch's all-to-all without overlap, so such a plan is refused before
    launch instead of running something else than it predicts."""
    from pipeexec.refusals import expert_parallel_refusals
    from pipesim.plan import Parallelism

    model = pipesim.plan.get_model("qwen3-30b-a3b")
    plain = Parallelism(dp=2, ep=2)
    assert expert_parallel_refusals(model, plain) == []
    deepep = expert_parallel_refusals(model, Parallelism(dp=2, ep=2, ep_dispatcher="deepep"))
    assert len(deepep) == 1 and "parallelism.ep_dispatcher = 'deepep'" in deepep[0]
    assert "set it to 'alltoall'" in deepep[0]
    overlap = expert_parallel_refusals(model, Parallelism(dp=2, ep=2, overlap_ep_comm=True))
    assert len(overlap) == 1 and "parallelism.overlap_ep_comm = True" in overlap[0]
    # at ep 1 nothing is dispatched: the knobs mean nothing and refuse nothing
    assert expert_parallel_refusals(model, Parallelism(dp=2, ep_dispatcher="hybridep")) == []


def test_a_plan_with_megatrons_recompute_modules_or_offloading_is_refused_naming_the_field():
    """pipesim plans Megatron's per-module recomputation and activation offloading; the
    executor recomputes the core attention or whole blocks and keeps activations on its device,
    so such a plan is refused before launch."""
    from pipeexec.refusals import memory_refusals
    from pipesim.plan import Parallelism

    assert memory_refusals(Parallelism(recompute="selective")) == []
    mods = memory_refusals(Parallelism(recompute="selective", recompute_modules=("moe_act",)))
    assert len(mods) == 1 and "parallelism.recompute_modules = ['moe_act']" in mods[0]
    off = memory_refusals(Parallelism(offload_layers=2))
    assert len(off) == 1 and "parallelism.offload_layers = 2" in off[0] and "set it to 0" in off[0]
