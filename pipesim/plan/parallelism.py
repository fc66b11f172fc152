"""`Parallelism`: how one training step is spread over GPUs and what it keeps or recomputes.

Sizes (tp, cp, pp, vpp, dp, ep), sequence parallelism, optimizer sharding (``zero``: 0 none,
1 Megatron's distributed optimizer / ZeRO-1, 2 ZeRO-2, 3 ZeRO-3 / FSDP), recomputation
(none / selective / full, optionally for ``recompute_layers`` layers of each stage, Megatron's
``--recompute-num-layers`` with the block method; selective over ``recompute_modules``,
Megatron's ``--recompute-modules``, `RECOMPUTE_MODULES`), activations of ``offload_layers``
layers of each stage kept in host memory (Megatron's ``--cpu-offloading-num-layers``), micro
and global batch
(``microbatches = global_batch_size / (micro_batch_size * dp)``), GEMM precision and the overlap
switches, and how context parallelism exchanges K/V (``cp_comm``, Megatron / Transformer
Engine's ``cp_comm_type``: ``p2p``, the ring overlapped with the attention; ``all_gather``, K/V
all-gathered before each attention and again in its backward, which recomputes the attention,
the exchange exposed: what pipeexec runs), and how the data-parallel gradients are
reduced under ZeRO-2/3 (``grad_reduce``, `GRAD_REDUCE`) and in which dtype
(``grad_reduce_in_fp32``), and how expert parallelism moves the routed tokens
(``ep_dispatcher``, `EP_DISPATCHERS`) and whether it hides that exchange under another
microbatch's compute (``overlap_ep_comm``). A frozen value; :meth:`pipesim.Plan.validate` checks it against the model and cluster.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from ..errors import PlanError
from ..fields import typed_fields
from ..hardware import EP_DISPATCHERS
from ..schedule.sharding import GRAD_REDUCE, Sharding

RECOMPUTE = ("none", "selective", "full")
# Megatron-Core's selective recomputation modules (--recompute-modules, TransformerConfig
# .recompute_modules): what each drops from the saved activations and runs again in the
# backward (pipesim.plan.footprint, pipesim.plan.operators.RECOMPUTED_OPS). "core_attn" is
# Megatron's default and pipesim's recompute="selective" without modules.
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mla_up_proj", "mlp", "moe_act", "moe",
                     "shared_experts")
# GEMM precisions: fp8 is per-tensor scaled FP8 (current or delayed scaling: Hopper and
# Blackwell), mxfp8 block-scaled FP8 and nvfp4 block-scaled FP4 (Blackwell only); activations,
# master weights and the optimizer stay as bf16 training keeps them
PRECISIONS = ("bf16", "fp16", "fp8", "mxfp8", "nvfp4", "fp32")
CP_COMM = ("p2p", "all_gather")     # Megatron's cp_comm_type names; a2a (Ulysses) not modelled
# When ZeRO-2/3 reduce-scatter the gradients: "per_step", accumulated over the microbatches in
# a full buffer and reduce-scattered once, overlapped with the last microbatch's backward
# (Megatron-LM's DDP: `no_sync` until the last microbatch; FSDP under gradient accumulation);
# "per_microbatch", reduce-scattered bucket by bucket inside every backward, only the shard
# kept (DeepSpeed's ZeRO stage 2). ZeRO-0/1 always reduce once a step. The program's own names
# (pipesim.schedule.sharding), so the plan and the actions it is lowered with cannot disagree.
# Megatron's token dispatchers, EP_DISPATCHERS (pipesim.hardware, where each GPU says which it
# runs): "alltoall" (NCCL all-to-all, one copy of a token an expert; Megatron's default,
# pipeexec's) or the flex dispatcher with its backend, "deepep" or "hybridep" (one copy a
# destination rank, and across NVLink domains one a destination domain, forwarded there over
# NVLink); they differ too in the permutes around the experts (operators.py)
FLEX_DISPATCHERS = ("deepep", "hybridep")
DEFAULT_EP_DISPATCHER = "alltoall"      # Megatron's default; the one dispatcher of ep 1


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1                 # model parts per rank (Schedule.parts_per_rank); stages
                                 # per rank too, but for a schedule holding copies (dualpipe)
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    zero: int = 0
    recompute: str = "none"
    recompute_layers: int | None = None     # full recomputation of this many layers per stage
    recompute_modules: tuple = ()           # RECOMPUTE_MODULES, with recompute="selective"
    offload_layers: int = 0                 # layers of each stage whose activations go to host
    micro_batch_size: int = 1
    global_batch_size: int | None = None    # default: micro_batch_size * dp (one microbatch)
    precision: str = "bf16"
    flash_attention: bool = True            # fused attention keeps no s x s scores
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    overlap_tp_comm: bool = False
    cp_comm: str = "p2p"                    # CP_COMM: ring (overlapped) or all-gather (exposed)
    grad_reduce: str = "per_step"           # GRAD_REDUCE: ZeRO-2/3's reduce-scatters, when
    # gradients accumulated and reduced in fp32 (Megatron-LM's --accumulate-allreduce-grads-in-
    # fp32); None: the precision's default, as Megatron-LM sets it (fp32 for bf16 / fp8 / fp32,
    # fp16 for fp16); False: in the 16-bit compute dtype (--grad-reduce-in-bf16)
    grad_reduce_in_fp32: bool | None = None
    ep_dispatcher: str = DEFAULT_EP_DISPATCHER  # EP_DISPATCHERS: how EP moves the routed tokens
    # Megatron's overlap_moe_expert_parallel_comm (Megatron-Bridge's moe_a2a_overlap): one
    # microbatch's dispatch / combine run under another's compute (default off, as Megatron's)
    overlap_ep_comm: bool = False

    def __post_init__(self) -> None:
        for f in ("tp", "pp", "dp", "vpp", "cp", "ep", "micro_batch_size"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"parallelism.{f}: must be a positive integer, got {value!r}")
        if self.global_batch_size is not None and (
                isinstance(self.global_batch_size, bool) or not isinstance(self.global_batch_size, int)
                or self.global_batch_size < 1):
            raise PlanError(f"parallelism.global_batch_size: must be a positive integer, got "
                            f"{self.global_batch_size!r}")
        if self.zero not in (0, 1, 2, 3):
            raise PlanError(f"parallelism.zero: must be 0 (none), 1 (distributed optimizer), 2 or 3, "
                            f"got {self.zero!r}")
        if self.recompute not in RECOMPUTE:
            raise PlanError(f"parallelism.recompute: {self.recompute!r} is not one of "
                            f"{', '.join(RECOMPUTE)}")
        if self.recompute_layers is not None:
            if self.recompute != "full":
                raise PlanError("parallelism.recompute_layers: only with recompute='full'")
            if not isinstance(self.recompute_layers, int) or self.recompute_layers < 0:
                raise PlanError(f"parallelism.recompute_layers: must be an integer >= 0, got "
                                f"{self.recompute_layers!r}")
        modules = self.recompute_modules
        if isinstance(modules, list):
            modules = tuple(modules)
            object.__setattr__(self, "recompute_modules", modules)
        if not isinstance(modules, tuple) or not all(isinstance(m, str) for m in modules):
            raise PlanError(f"parallelism.recompute_modules: must be a list of module names, "
                            f"got {modules!r}")
        unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
        if unknown:
            raise PlanError(f"parallelism.recompute_modules: {', '.join(map(repr, unknown))} "
                            f"not one of {', '.join(RECOMPUTE_MODULES)}")
        if len(set(modules)) != len(modules):
            raise PlanError(f"parallelism.recompute_modules: names a module twice: {modules!r}")
        if modules and self.recompute != "selective":
            raise PlanError(f"parallelism.recompute_modules: only with recompute='selective' "
                            f"(Megatron's --recompute-granularity selective), got recompute="
                            f"{self.recompute!r}")
        if isinstance(self.offload_layers, bool) or not isinstance(self.offload_layers, int) \
                or self.offload_layers < 0:
            raise PlanError(f"parallelism.offload_layers: must be an integer >= 0, got "
                            f"{self.offload_layers!r}")
        if self.cp_comm not in CP_COMM:
            extra = (" (a2a, Ulysses' all-to-all over heads, is not modelled)"
                     if self.cp_comm == "a2a" else "")
            raise PlanError(f"parallelism.cp_comm: {self.cp_comm!r} is not one of "
                            f"{', '.join(CP_COMM)}{extra}")
        if self.precision not in PRECISIONS:
            raise PlanError(f"parallelism.precision: {self.precision!r} is not one of "
                            f"{', '.join(PRECISIONS)}")
        if self.grad_reduce not in GRAD_REDUCE:
            raise PlanError(f"parallelism.grad_reduce: {self.grad_reduce!r} is not one of "
                            f"{', '.join(GRAD_REDUCE)}")
        if self.ep_dispatcher not in EP_DISPATCHERS:
            raise PlanError(f"parallelism.ep_dispatcher: {self.ep_dispatcher!r} is not one of "
                            f"{', '.join(EP_DISPATCHERS)}")
        if self.grad_reduce_in_fp32 is not None and not isinstance(self.grad_reduce_in_fp32, bool):
            raise PlanError(f"parallelism.grad_reduce_in_fp32: must be true, false or null (the "
                            f"precision's default), got {self.grad_reduce_in_fp32!r}")
        if self.grad_reduce_in_fp32 is False and self.precision == "fp32":
            raise PlanError("parallelism.grad_reduce_in_fp32: false asks for 16-bit gradients, "
                            "but precision fp32 computes them in fp32; drop it or train in "
                            "bf16 / fp16")

    @property
    def gbs(self) -> int:
        return self.micro_batch_size * self.dp if self.global_batch_size is None else self.global_batch_size

    @property
    def microbatches(self) -> int:
        """m = global batch / (micro batch x dp); validate() checks that it divides."""
        return self.gbs // (self.micro_batch_size * self.dp)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    @property
    def grads_sharded(self) -> bool:
        """Whether a rank keeps only its shard of the gradients through the step: ZeRO-2/3
        reducing once a microbatch (per step, the whole buffer accumulates first)."""
        return self.zero >= 2 and self.grad_reduce == "per_microbatch"

    @property
    def recomputed_modules(self) -> frozenset:
        """The modules selective recomputation runs again (``recompute_modules``, or Megatron's
        default, the core attention); empty unless ``recompute`` is selective."""
        if self.recompute != "selective":
            return frozenset()
        return frozenset(self.recompute_modules or ("core_attn",))

    @property
    def sharding(self) -> Sharding | None:
        """The ZeRO actions the plan's program is lowered with (`pipesim.schedule.sharding`):
        ZeRO-2/3 with its ``grad_reduce``; None below (ZeRO-0/1 insert nothing) and with one
        data-parallel replica (nothing to shard: Megatron's and pipeexec's holder run it
        unsharded)."""
        if self.zero < 2 or self.dp * self.cp == 1:
            return None
        return Sharding(self.zero, self.grad_reduce)

    @property
    def grads_fp32(self) -> bool:
        """Whether gradients are accumulated and reduced in fp32 (`grad_reduce_in_fp32`)."""
        if self.grad_reduce_in_fp32 is None:
            return self.precision != "fp16"
        return self.grad_reduce_in_fp32

    @property
    def sp(self) -> int:
        """The factor sequence parallelism divides the replicated activations by (tp or 1)."""
        return self.tp if self.sequence_parallel else 1

    def with_(self, **changes: Any) -> "Parallelism":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "parallelism") -> "Parallelism":
        return cls(**typed_fields(cls, data, "parallelism", source, PlanError))

    def short(self) -> str:
        parts = [f"tp={self.tp}" + ("+sp" if self.sequence_parallel and self.tp > 1 else ""),
                 f"cp={self.cp}" + ("(all_gather)" if self.cp > 1 and self.cp_comm == "all_gather"
                                    else ""), f"pp={self.pp}", f"vpp={self.vpp}", f"dp={self.dp}"]
        if self.ep > 1:
            parts.append(f"ep={self.ep}" + (f"({self.ep_dispatcher})"
                                             if self.ep_dispatcher != "alltoall" else "")
                         + ("+overlap" if self.overlap_ep_comm else ""))
        parts += [f"mbs={self.micro_batch_size}", f"gbs={self.gbs} (m={self.microbatches})",
                  f"recompute={self.recompute}"
                  + (f"[{self.recompute_layers}]" if self.recompute_layers is not None else "")
                  + (f"({','.join(self.recompute_modules)})" if self.recompute_modules else "")
                  + (f" offload={self.offload_layers}" if self.offload_layers else ""),
                  f"zero={self.zero}"
                  + ("(per microbatch)" if self.zero >= 2 and self.grads_sharded else ""),
                  self.precision + ("" if self.grad_reduce_in_fp32 is None
                                    else " fp32-grads" if self.grads_fp32 else " 16-bit-grads")]
        return " ".join(parts)
