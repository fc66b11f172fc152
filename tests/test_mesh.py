"""The executor's device mesh numbers ranks and forms groups as Megatron-LM does.

The reference is a transcription of Megatron-LM's ``generate_masked_orthogonal_rank_groups``
(megatron/core/parallel_state.py, used by its ``RankGenerator`` with order "tp-cp-dp-pp"),
written here independently of `pipeexec.parallel.mesh`. Torch-free: the mesh is checked before
any process starts. The expert layout is Megatron's expert ``RankGenerator``
(``expert_decoder_rank_generator``: order "tp-ep-dp-pp" over the same world, expert tp = tp,
expert dp = dp * cp / ep), the same masked orthogonal groups over sizes (tp, ep, edp, pp).
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeexec.parallel.mesh import DIMS, Mesh


def _prefix_product(a: list[int]) -> list[int]:
    out, acc = [1], 1
    for v in a:
        acc *= v
        out.append(acc)
    return out


def _decompose(index: int, shape: list[int]) -> list[int]:
    stride = _prefix_product(shape)
    return [(index // d) % s for s, d in zip(shape, stride)]


def megatron_groups(sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Megatron-LM's masked orthogonal rank groups: ``sizes`` in order (fastest first),
    ``mask`` the dimensions a group spans."""
    world = _prefix_product(sizes)[-1]
    masked = [s for s, m in zip(sizes, mask) if m]
    unmasked = [s for s, m in zip(sizes, mask) if not m]
    stride = _prefix_product(sizes)
    masked_stride = [d for d, m in zip(stride, mask) if m]
    unmasked_stride = [d for d, m in zip(stride, mask) if not m]
    size = _prefix_product(masked)[-1]
    groups = []
    for g in range(world // size):
        gi = _decompose(g, unmasked)
        groups.append([sum(a * b for a, b in zip(_decompose(r, masked), masked_stride))
                       + sum(a * b for a, b in zip(gi, unmasked_stride)) for r in range(size)])
    return groups


sizes = st.integers(min_value=1, max_value=4)


@settings(max_examples=60, deadline=None)
@given(tp=sizes, cp=sizes, dp=sizes, pp=sizes,
       dims=st.sets(st.sampled_from(DIMS), min_size=1))
def test_groups_are_megatrons(tp, cp, dp, pp, dims):
    mesh = Mesh(tp=tp, cp=cp, dp=dp, pp=pp)
    want = megatron_groups([tp, cp, dp, pp], [d in dims for d in DIMS])
    assert sorted(map(list, mesh.groups(tuple(dims)))) == sorted(want)
    for group in mesh.groups(tuple(dims)):
        for r in group:
            assert mesh.group(tuple(dims), r) == group


@settings(max_examples=60, deadline=None)
@given(tp=sizes, cp=sizes, dp=sizes, pp=sizes)
def test_rank_and_coords_are_inverse(tp, cp, dp, pp):
    mesh = Mesh(tp=tp, cp=cp, dp=dp, pp=pp)
    for r in range(mesh.world_size):
        c = mesh.coords(r)
        assert mesh.rank(tp=c.tp, cp=c.cp, dp=c.dp, pp=c.pp) == r


def test_tensor_parallel_is_fastest_and_old_numbering_stays():
    mesh = Mesh(tp=2, dp=2, pp=2)
    assert mesh.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert mesh.groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert mesh.groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    old = Mesh(dp=3, pp=2)          # tp = cp = 1: rank = pp_rank * dp + dp_rank
    assert all(old.rank(pp=p, dp=d) == p * 3 + d for p in range(2) for d in range(3))


def test_bad_mesh_and_rank_are_named():
    with pytest.raises(ValueError, match="tp must be a positive integer, got 0"):
        Mesh(tp=0)
    with pytest.raises(ValueError, match="rank 8 outside 0..7"):
        Mesh(tp=2, pp=4).coords(8)
    with pytest.raises(ValueError, match="unknown dimension 'ep'"):
        Mesh().group("ep", 0)
    with pytest.raises(ValueError, match=r"ep = 3 must divide dp \* cp = 2 \* 2 = 4"):
        Mesh(dp=2, cp=2, ep=3)


@settings(max_examples=80, deadline=None)
@given(tp=sizes, cp=sizes, dp=sizes, pp=sizes, ep_index=st.integers(0, 3))
def test_expert_groups_are_megatrons(tp, cp, dp, pp, ep_index):
    divisors = [e for e in range(1, dp * cp + 1) if dp * cp % e == 0]
    ep = divisors[ep_index % len(divisors)]
    mesh = Mesh(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)
    edp = dp * cp // ep
    expert_sizes = [tp, ep, edp, pp]           # Megatron's "tp-ep-dp-pp", fastest first
    assert sorted(map(list, mesh.ep_groups())) == sorted(
        megatron_groups(expert_sizes, [False, True, False, False]))
    assert sorted(map(list, mesh.edp_groups())) == sorted(
        megatron_groups(expert_sizes, [False, False, True, False]))
    for group in mesh.ep_groups():
        # one dp x cp group's ranks, one tp rank, one pipeline position
        dpcp = mesh.group(("dp", "cp"), group[0])
        assert set(group) <= set(dpcp)
        assert len({mesh.coords(r).tp for r in group}) == 1
        assert len({mesh.coords(r).pp for r in group}) == 1
        for e, r in enumerate(group):
            assert mesh.ep_group(r) == group and mesh.expert_coords(r).ep == e
    for r in range(mesh.world_size):
        c = mesh.expert_coords(r)
        assert mesh.expert_rank(tp=c.tp, ep=c.ep, edp=c.edp, pp=c.pp) == r
        # an ep group and an edp group meet in this rank alone; together, its dp x cp group
        assert set(mesh.ep_group(r)) & set(mesh.edp_group(r)) == {r}
        assert len(mesh.ep_group(r)) * len(mesh.edp_group(r)) == dp * cp


def test_expert_layout_by_hand():
    mesh = Mesh(tp=2, dp=4, pp=2, ep=2)
    assert mesh.ep_groups()[:4] == [(0, 2), (1, 3), (4, 6), (5, 7)]   # stride tp
    assert mesh.edp_groups()[:4] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert Mesh(dp=4, ep=4).ep_groups() == [(0, 1, 2, 3)]
    assert Mesh(dp=4, ep=4).edp_groups() == [(0,), (1,), (2,), (3,)]
