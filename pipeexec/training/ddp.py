"""Gradient buffers and data-parallel reduction.

All parameters of a rank's stages get their gradient in one flat fp32 buffer (a ``main_grad``
view per parameter, Megatron's layout): backward passes of every microbatch accumulate into it in
fp32 whatever the compute precision, the global norm is one ``norm()`` of the buffer, and data
parallelism is one bucketed all-reduce of it per step, after the last backward (not per
microbatch), averaged over the replicas.

Expert parallelism: the parameters ``is_expert`` picks (a rank's share of a MoE layer's
experts) lie after every dense one, in a region of their own, reduced over the
expert-data-parallel group instead (`all_reduce_experts`): summed there and divided by the
same dp x cp as the dense ones (Megatron's expert gradient scaling), since each of those ranks'
gradients already sums the tokens of its whole expert-parallel group.
"""
from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


class GradBuffer:
    def __init__(self, params_by_stage: dict[int, Sequence[torch.nn.Parameter]],
                 device: torch.device, bucket_bytes: int = 25 * 2 ** 20, *,
                 is_expert: Callable[[torch.nn.Parameter], bool] | None = None) -> None:
        self.params = {s: list(ps) for s, ps in params_by_stage.items()}
        total = sum(p.numel() for ps in params_by_stage.values() for p in ps)
        self.data = torch.zeros(total, dtype=torch.float32, device=device)
        expert = is_expert or (lambda p: False)
        dense_total = sum(p.numel() for ps in params_by_stage.values() for p in ps
                          if not expert(p))
        self.dense, self.experts = self.data[:dense_total], self.data[dense_total:]
        self.views: dict[int, list[torch.Tensor]] = {}
        offset = {False: 0, True: dense_total}
        for s, ps in params_by_stage.items():
            views = []
            for p in ps:
                n, e = p.numel(), expert(p)
                views.append(self.data[offset[e]: offset[e] + n].view(p.shape))
                offset[e] += n
            self.views[s] = views
        self.bucket_elems = max(1, bucket_bytes // 4)

    def bind(self) -> bool:
        """Point every fp32 parameter's ``.grad`` at its view of the buffer, so that autograd
        accumulates into the buffer in place (``PipelineRuntime(grads_in_place=True)``).
        Returns False, binding nothing, when some parameter is not fp32."""
        if any(p.dtype != torch.float32 for ps in self.params.values() for p in ps):
            return False
        for s, ps in self.params.items():
            for p, view in zip(ps, self.views[s]):
                p.grad = view
        return True

    def zero(self) -> None:
        self.data.zero_()

    def accumulate(self, stage: int, grads: Sequence[torch.Tensor | None]) -> None:
        for view, g in zip(self.views[stage], grads):
            if g is not None:
                view.add_(g)

    def all_reduce(self, group, world: int, timeout: float | None = None) -> None:
        """Average the dense gradients over ``group`` (``world`` replicas): bucketed, posted
        together (the whole buffer when there are no expert parameters)."""
        self._reduce(self.dense, group, world, world, timeout)

    def all_reduce_experts(self, group, size: int, world: int,
                           timeout: float | None = None) -> None:
        """Sum the expert gradients over ``group`` (``size`` ranks holding the same experts)
        and divide by ``world`` (the dense gradients' dp x cp)."""
        self._reduce(self.experts, group, size, world, timeout)

    def _reduce(self, data: torch.Tensor, group, size: int, world: int,
                timeout: float | None) -> None:
        if data.numel() == 0:
            return
        if group is not None and size > 1:
            works = []
            n = data.numel()
            for start in range(0, n, self.bucket_elems):
                works.append(dist.all_reduce(data[start: start + self.bucket_elems],
                                             group=group, async_op=True))
            for w in works:
                if timeout is None:
                    w.wait()
                else:
                    w.wait(datetime.timedelta(seconds=timeout))
        if world > 1:
            data.div_(world)
