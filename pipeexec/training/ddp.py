"""Gradient buffers and data-parallel reduction.

All parameters of a rank's stages get their gradient in one flat fp32 buffer (a ``main_grad``
view per parameter, Megatron's layout): backward passes of every microbatch accumulate into it in
fp32 whatever the compute precision, the global norm is one ``norm()`` of the buffer, and data
parallelism is one bucketed all-reduce of it per step, after the last backward (not per
microbatch), averaged over the replicas.
"""
from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist


class GradBuffer:
    def __init__(self, params_by_stage: dict[int, Sequence[torch.nn.Parameter]],
                 device: torch.device, bucket_bytes: int = 25 * 2 ** 20) -> None:
        self.params = {s: list(ps) for s, ps in params_by_stage.items()}
        total = sum(p.numel() for ps in params_by_stage.values() for p in ps)
        self.data = torch.zeros(total, dtype=torch.float32, device=device)
        self.views: dict[int, list[torch.Tensor]] = {}
        offset = 0
        for s, ps in params_by_stage.items():
            views = []
            for p in ps:
                n = p.numel()
                views.append(self.data[offset: offset + n].view(p.shape))
                offset += n
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
        """Average the buffer over ``group`` (``world`` replicas): bucketed, posted together."""
        if group is None or world == 1:
            return
        works = []
        n = self.data.numel()
        for start in range(0, n, self.bucket_elems):
            works.append(dist.all_reduce(self.data[start: start + self.bucket_elems], group=group,
                                         async_op=True))
        for w in works:
            if timeout is None:
                w.wait()
            else:
                w.wait(datetime.timedelta(seconds=timeout))
        self.data.div_(world)
