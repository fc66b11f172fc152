"""Backward passes of one stage: full (B) and split into input (I) and weight (W) gradients.

Zero Bubble's split: I computes only the gradient of the stage input (what the previous stage
waits for); W later computes the weight gradients without redoing I's work.

How, on torch's autograd graph (the same idea as torch.distributed.pipelining's
``stage_backward_input`` / ``stage_backward_weight``, written independently here):

* The *input path* is the set of graph nodes through which the stage input reaches the output.
  I runs autograd from the output to the input only, so autograd evaluates only the input path.
* A parameter's branch joins the input path at some nodes (e.g. the ``addmm`` of a Linear,
  which computes both dX and dW). Before I, a pre-hook on each join node records the gradient
  arriving there. Join nodes that share parameters form one group.
* W runs autograd once per group, from the join nodes with the recorded gradients to the group's
  parameters: only the parameter branches are evaluated (``dW = X^T dY`` of each Linear, the
  LayerNorm affine terms, ...). When a group has several join nodes, a pre-hook pins each one
  to its recorded gradient, so a gradient is not counted twice through a later join node.

A stage whose input needs no gradient (the first stage: token ids) has nothing for I to do:
I is then a no-op and W runs the whole backward. Parameters that reach the output without
touching the input path get their gradient in I.

``into_grad=True`` (B and W): instead of returning the parameter gradients, let autograd add
them into each parameter's ``.grad``, which the caller has pointed at its fp32 gradient buffer
(torch DDP's ``gradient_as_bucket_view``): one in-place add per parameter inside autograd, with
no gradient tensor handed back to Python and added again. Only when parameters are fp32.

Outputs are given as ``GradientEdge`` s, not tensors: after a send the runtime replaces the
output's storage with a one-element placeholder (Megatron's deallocate trick), and a gradient
edge carries the original shape in the graph's metadata.
"""
from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node


def grad_node(t: torch.Tensor) -> Node | None:
    """The node that receives ``t``'s gradient: its grad_fn, or its AccumulateGrad (leaves)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    # AccumulateGrad nodes are created lazily and cached on the tensor: a view makes it exist.
    return t.view_as(t).grad_fn.next_functions[0][0]


def full_backward(root: GradientEdge, grad_output: torch.Tensor | None,
                  stage_input: torch.Tensor | None, params: Sequence[torch.nn.Parameter],
                  into_grad: bool = False
                  ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """B: gradients of the stage input (None when it needs none) and of every parameter (all
    None with ``into_grad``: they were added into ``.grad``)."""
    want_input = stage_input is not None and stage_input.requires_grad
    inputs = ([stage_input] if want_input else []) + list(params)
    if into_grad:
        _backward_into_grad([root], inputs, grad_output)
        dx = None
        if want_input:
            dx, stage_input.grad = stage_input.grad, None
        return dx, [None] * len(params)
    grads = torch.autograd.grad([root], inputs, None if grad_output is None else [grad_output],
                                allow_unused=True)
    if want_input:
        return grads[0], list(grads[1:])
    return None, list(grads)


def _backward_into_grad(roots: list, inputs: list[torch.Tensor],
                        grad_output: torch.Tensor | None) -> None:
    """Run autograd from ``roots`` and add the gradients of ``inputs`` into their ``.grad``."""
    inputs = [t for t in inputs if t.requires_grad]
    if inputs:
        torch.autograd.backward(roots, None if grad_output is None else [grad_output],
                                inputs=inputs)


class WeightGradient:
    """What W needs after I: the recorded gradients at the join nodes, grouped by parameters."""

    __slots__ = ("_groups", "_root", "_grad_output", "_params")

    def __init__(self, groups, root=None, grad_output=None, params=None) -> None:
        self._groups = groups            # [(nodes, recorded grads per node, param indices)]
        self._root = root                # set when W must run the whole backward
        self._grad_output = grad_output
        self._params = params

    def compute(self, params: Sequence[torch.nn.Parameter], into_grad: bool = False
                ) -> list[torch.Tensor | None]:
        """W: the weight gradients (None for parameters that got theirs in I or are unused, and
        for all with ``into_grad``: they were added into ``.grad``)."""
        out: list[torch.Tensor | None] = [None] * len(params)
        if self._root is not None:
            idx = self._params
            if into_grad:
                _backward_into_grad([self._root], [params[i] for i in idx], self._grad_output)
                self._root = self._grad_output = None
                return out
            grads = torch.autograd.grad([self._root], [params[i] for i in idx],
                                        None if self._grad_output is None else [self._grad_output],
                                        allow_unused=True)
            for i, g in zip(idx, grads):
                out[i] = g
            self._root = self._grad_output = None
            return out
        for nodes, recorded, pidx in self._groups:
            edges, grads = [], []
            for node, node_grads in zip(nodes, recorded):
                if node_grads is None:
                    continue
                for k, g in enumerate(node_grads):
                    if g is not None:
                        edges.append(GradientEdge(node, k))
                        grads.append(g)
            if not edges:
                continue
            handles = []
            if len(nodes) > 1:
                for node, node_grads in zip(nodes, recorded):
                    if node_grads is not None:
                        handles.append(node.register_prehook(lambda _g, saved=node_grads: saved))
            try:
                if into_grad:
                    torch.autograd.backward(edges, grads, retain_graph=True,
                                            inputs=[params[i] for i in pidx])
                    continue
                dws = torch.autograd.grad(edges, [params[i] for i in pidx], grads,
                                          retain_graph=True, allow_unused=True)
            finally:
                for h in handles:
                    h.remove()
            for i, g in zip(pidx, dws):
                out[i] = g
        self._groups = ()
        return out


def backward_input(root: GradientEdge, grad_output: torch.Tensor | None,
                   stage_input: torch.Tensor | None, params: Sequence[torch.nn.Parameter]
                   ) -> tuple[torch.Tensor | None, list[torch.Tensor | None], WeightGradient]:
    """I: the stage input's gradient; returns (input grad, parameter grads computed now, W state).

    The parameter grads computed now are those of parameters whose branch never joins the input
    path (rare); every other parameter is left to ``WeightGradient.compute``.
    """
    n = len(params)
    param_nodes = [grad_node(p) for p in params]
    if stage_input is None or not stage_input.requires_grad:
        used = [i for i in range(n) if param_nodes[i] is not None]
        return None, [None] * n, WeightGradient((), root, grad_output, used)

    # Reverse graph: node -> the nodes that consume its output (towards the stage output).
    consumers: dict[Node, list[Node]] = defaultdict(list)
    seen = {root.node}
    queue = deque([root.node])
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            consumers[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    input_node = grad_node(stage_input)
    on_path: set[Node] = set()
    if input_node in seen:
        on_path.add(input_node)
        queue.append(input_node)
        while queue:
            for c in consumers[queue.popleft()]:
                if c not in on_path:
                    on_path.add(c)
                    queue.append(c)

    # For each parameter, the join nodes where its branch meets the input path.
    parent: dict[Node, Node] = {}          # union-find over join nodes

    def find(x: Node) -> Node:
        while parent[x] is not x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    param_joins: list[list[Node]] = []
    direct: list[int] = []
    for i, pnode in enumerate(param_nodes):
        joins: list[Node] = []
        if pnode is not None and pnode in seen:
            visited = {pnode}
            queue.append(pnode)
            while queue:
                for c in consumers[queue.popleft()]:
                    if c in visited:
                        continue
                    visited.add(c)
                    if c in on_path:
                        joins.append(c)
                    else:
                        queue.append(c)
            if not joins:
                direct.append(i)
        param_joins.append(joins)
        for j in joins:
            parent.setdefault(j, j)
        for j in joins[1:]:
            ra, rb = find(joins[0]), find(j)
            if ra is not rb:
                parent[rb] = ra

    group_of: dict[Node, int] = {}
    groups: list[tuple[list[Node], list, list[int]]] = []
    for j in parent:
        r = find(j)
        if r not in group_of:
            group_of[r] = len(groups)
            groups.append(([], [], []))
        g = groups[group_of[r]]
        g[0].append(j)
        g[1].append(None)
    for i, joins in enumerate(param_joins):
        if joins:
            groups[group_of[find(joins[0])]][2].append(i)

    handles = []
    for nodes, recorded, _ in groups:
        for k, node in enumerate(nodes):
            def hook(grad_outputs, recorded=recorded, k=k):
                recorded[k] = grad_outputs
            handles.append(node.register_prehook(hook))
    try:
        inputs = [stage_input] + [params[i] for i in direct]
        grads = torch.autograd.grad([root], inputs, None if grad_output is None else [grad_output],
                                    retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    now: list[torch.Tensor | None] = [None] * n
    for i, g in zip(direct, grads[1:]):
        now[i] = g
    return grads[0], now, WeightGradient(groups)
