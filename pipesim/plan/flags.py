"""The layout, batch and model-shape flags of every command line, as one table next to the
Plan fields they set.

``pipesim simulate``, ``pipesim plan``, ``pipeexec train`` and ``pipeexec compare`` add their
flags from `PLAN_FLAGS` (`add_plan_flags`), so a flag has one name, one meaning and one help
text everywhere; each command gives only its own defaults (pipesim simulates pp 4 x 8
microbatches, pipeexec trains a single process by default). The rule for a plan file is the
same in every command: ``--plan FILE`` is the base, and a flag given on the command line
overrides that field of it (`apply_flags`). ``pipesim plan`` searches: its searchable flags take
several values (`several`), the others one, and every value is a filter of the search.

Lists read the same in every command: ``--pp 2,4`` and ``--pp 2 4`` are both two values
(`values`). Torch-free.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import PlanError
from .model import ModelSpec, get_model
from .parallelism import (CP_COMM, EP_DISPATCHERS, GRAD_REDUCE, PRECISIONS, RECOMPUTE,
                          RECOMPUTE_MODULES)

GROUPS = ("layout", "batch", "model")


@dataclass(frozen=True)
class PlanFlag:
    """One flag: its name (and aliases), the Plan field it sets, help and argparse settings.

    ``field``: ``parallelism.<name>``, ``model.<name>`` or ``batch.microbatches`` (the global
    batch in microbatches per replica: it sets ``parallelism.global_batch_size``) or ``model``
    (the model itself: a preset or a Hugging Face config). ``searchable``: ``pipesim plan``
    searches a list of its values."""

    flag: str
    field: str
    group: str
    help: str
    type: Callable[[str], Any] | None = int
    choices: tuple | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()
    boolean: bool = False
    searchable: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def name(self) -> str:
        """The field's own name (``parallelism.tp`` -> ``tp``)."""
        return self.field.rsplit(".", 1)[-1]


PLAN_FLAGS: tuple[PlanFlag, ...] = (
    # -- layout: how the ranks are laid out and what each keeps --------------------------------
    PlanFlag("--tp", "parallelism.tp", "layout", "tensor-parallel size (ranks sharing each "
             "layer's matrices)", searchable=True),
    PlanFlag("--cp", "parallelism.cp", "layout", "context-parallel size (ranks sharing each "
             "sequence)", searchable=True),
    PlanFlag("--ep", "parallelism.ep", "layout", "expert-parallel size (MoE models: ranks "
             "sharing the experts)", searchable=True),
    PlanFlag("--ep-dispatcher", "parallelism.ep_dispatcher", "layout", "how expert "
             "parallelism moves the routed tokens (Megatron's --moe-token-dispatcher-type "
             "alltoall, or flex with --moe-flex-dispatcher-backend deepep / hybridep): alltoall "
             "(NCCL, a copy a token an expert; Megatron's default, pipeexec's), deepep or "
             "hybridep (a copy a destination rank, one a remote NVLink domain; `pipesim plan`'s "
             "default: the dispatchers the hardware runs, tried at ep > 1)", type=str,
             choices=EP_DISPATCHERS, searchable=True),
    PlanFlag("--pp", "parallelism.pp", "layout", "pipeline-parallel size (pipeline ranks)",
             searchable=True),
    PlanFlag("--vpp", "parallelism.vpp", "layout", "model chunks per pipeline rank "
             "(Megatron's virtual pipeline size): the stages a rank holds, except where a "
             "schedule also holds copies (dualpipe: vpp 1, two stages a rank)", searchable=True),
    PlanFlag("--dp", "parallelism.dp", "layout", "data-parallel replicas", searchable=True),
    PlanFlag("--sequence-parallel", "parallelism.sequence_parallel", "layout",
             "Megatron's sequence parallelism inside the tensor-parallel group (norms and "
             "dropout sharded along the sequence)", type=None, boolean=True),
    PlanFlag("--zero", "parallelism.zero", "layout", "optimizer sharding over dp x cp: 0 none, "
             "1 Megatron's distributed optimizer (optimizer states and fp32 master weights), "
             "2 gradients too, 3 parameters too", choices=(0, 1, 2, 3), searchable=True),
    PlanFlag("--grad-reduce", "parallelism.grad_reduce", "layout", "when ZeRO-2/3 reduce-scatter "
             "the gradients: per_step (accumulated over the microbatches in the whole buffer, "
             "reduced once, overlapped with the last backward: Megatron, FSDP) or "
             "per_microbatch (inside every backward, only the shard kept: DeepSpeed's stage 2)",
             type=str, choices=GRAD_REDUCE),
    PlanFlag("--grad-reduce-in-fp32", "parallelism.grad_reduce_in_fp32", "layout",
             "accumulate and reduce the gradients in fp32 (Megatron-LM's default for bf16; "
             "--no-grad-reduce-in-fp32: in the 16-bit compute dtype, fp16's default)",
             type=None, boolean=True),
    PlanFlag("--recompute", "parallelism.recompute", "layout", "activation recomputation: none, "
             "selective (core attention recomputed in the backward) or full (each transformer "
             "block keeps only its input)", type=str, choices=RECOMPUTE, searchable=True),
    PlanFlag("--recompute-layers", "parallelism.recompute_layers", "layout",
             "with --recompute full: recompute the first N transformer blocks of each stage "
             "(Megatron's --recompute-num-layers, block method; default: all)", metavar="N"),
    PlanFlag("--recompute-modules", "parallelism.recompute_modules", "layout",
             "with --recompute selective: the modules recomputed in the backward (Megatron's "
             "--recompute-modules: " + ", ".join(RECOMPUTE_MODULES) + "; default core_attn)",
             type=None, metavar="M,N"),
    PlanFlag("--offload-layers", "parallelism.offload_layers", "layout",
             "keep the activations of the first N layers of each stage in host memory, copied "
             "out after their forward and back before their backward (Megatron's "
             "--cpu-offloading-num-layers; default 0)", metavar="N"),
    PlanFlag("--cp-comm", "parallelism.cp_comm", "layout", "how context parallelism "
             "exchanges K/V: p2p (Megatron / Transformer Engine's ring, overlapped with the "
             "attention) or all_gather (pipeexec's: gathered before each attention and again in "
             "its backward, which recomputes the attention, exposed; plan for pipeexec with it)",
             type=str, choices=CP_COMM),
    PlanFlag("--tp-comm-overlap", "parallelism.overlap_tp_comm", "layout",
             "Megatron's --tp-comm-overlap (userbuffers; with --sequence-parallel): each "
             "tensor-parallel all-gather / reduce-scatter in tp chunks under the GEMM it feeds "
             "or drains, only what the GEMM cannot hide shown, the GEMM slowed by what it hides "
             "(default off, as Megatron's)", type=None, boolean=True),
    PlanFlag("--overlap-moe-expert-parallel-comm", "parallelism.overlap_ep_comm", "layout",
             "Megatron's --overlap-moe-expert-parallel-comm (with --delay-wgrad-compute): a MoE "
             "layer's dispatch and combine hidden under another microbatch's compute, what it "
             "cannot hide shown, the compute slowed by what it hides (default off, as "
             "Megatron's; MoE plans at ep > 1; pipeexec does not run it)",
             type=None, boolean=True),
    PlanFlag("--precision", "parallelism.precision", "layout", "compute precision (bf16 / fp16 "
             "keep fp32 master weights; fp8: per-tensor scaled FP8 GEMMs, H100 and later; mxfp8, "
             "nvfp4: block-scaled FP8 / FP4 GEMMs, Blackwell only)", type=str,
             choices=PRECISIONS),
    # -- batch ---------------------------------------------------------------------------------
    PlanFlag("--micro-batch-size", "parallelism.micro_batch_size", "batch",
             "sequences per microbatch", aliases=("--mbs",), searchable=True),
    PlanFlag("--microbatches", "batch.microbatches", "batch", "microbatches per replica per "
             "step (the global batch is microbatches x micro-batch-size x dp)",
             aliases=("-m",)),
    PlanFlag("--global-batch-size", "parallelism.global_batch_size", "batch", "sequences per "
             "step, over all replicas (sets the microbatches: B / (micro-batch-size x dp))",
             metavar="B", aliases=("--gbs",)),
    # -- model shape ---------------------------------------------------------------------------
    PlanFlag("--model", "model", "model", "the model: a preset (`pipesim models`), a Hugging "
             "Face config.json or the directory holding it", type=str,
             metavar="PRESET|config.json|DIR"),
    PlanFlag("--layers", "model.layers", "model", "transformer layers (blocks)"),
    PlanFlag("--hidden", "model.hidden", "model", "model width (divisible by --heads)"),
    PlanFlag("--heads", "model.heads", "model", "attention heads"),
    PlanFlag("--kv-heads", "model.kv_heads", "model", "key/value heads (grouped-query "
             "attention; divides --heads)"),
    PlanFlag("--ffn-hidden", "model.ffn_hidden", "model", "MLP width (default 4 x hidden)"),
    PlanFlag("--seq-len", "model.seq_length", "model", "tokens per sequence",
             aliases=("--seq",), metavar="S"),
    PlanFlag("--vocab", "model.vocab", "model", "vocabulary size"),
    PlanFlag("--tie-embeddings", "model.tied_embeddings", "model", "the LM head's weight is "
             "the token embedding (Megatron's default, GPT-2's), one parameter across the first "
             "and last stages", type=None, boolean=True),
)

BY_DEST: dict[str, PlanFlag] = {f.dest: f for f in PLAN_FLAGS}
DESTS: tuple[str, ...] = tuple(BY_DEST)


def values(cast: Callable[[str], Any], choices: Sequence | None = None) -> Callable[[str], tuple]:
    """An argparse ``type`` reading one token of a list: ``2,4`` -> (2, 4) (with ``nargs='+'``
    ``--pp 2,4`` and ``--pp 2 4`` read the same; `flatten` joins the tokens)."""
    def parse(text: str) -> tuple:
        out = []
        for part in str(text).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                value = cast(part)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{part!r} is not a valid value") from None
            if choices is not None and value not in choices:
                raise argparse.ArgumentTypeError(
                    f"{part!r}: choose from {', '.join(str(c) for c in choices)}")
            out.append(value)
        if not out:
            raise argparse.ArgumentTypeError(f"no value in {text!r}")
        return tuple(out)
    return parse


def flatten(tokens: Iterable[tuple] | None) -> tuple | None:
    """The values of a list flag given as ``--pp 2,4``, ``--pp 2 4`` or ``--pp 2 --pp 4``."""
    if tokens is None:
        return None
    out: list = []
    for token in tokens:
        out.extend(token if isinstance(token, tuple) else (token,))
    return tuple(dict.fromkeys(out))


class _Several(argparse.Action):
    """``nargs='+'`` that also collects repeated flags (``--pp 2 --pp 4``), the command's
    default dropped at the first value given."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, given: Any,
                 option_string: str | None = None) -> None:
        current = getattr(namespace, self.dest, None)
        start = [] if current is None or current is self.default else list(current)
        setattr(namespace, self.dest, start + list(given))


def add_plan_flags(parser: Any, *, defaults: Mapping[str, Any] | None = None,
                   several: Iterable[str] = (), omit: Iterable[str] = (),
                   group_titles: Mapping[str, str] | None = None) -> None:
    """Add the table's flags to ``parser`` (one argument group per `GROUPS` entry).

    ``defaults``: dest -> this command's default (shown in its help; None: not given, the
    plan file's or the base plan's value). ``several``: dests that take several values
    (``pipesim plan``'s searched knobs; values from `flatten`). ``omit``: dests this command
    does not take (none of the four commands omits any: a test checks it)."""
    defaults = dict(defaults or {})
    several, omit = set(several), set(omit)
    titles = {"layout": "parallel layout", "batch": "batch", "model": "model shape",
              **(group_titles or {})}
    groups = {g: parser.add_argument_group(titles[g]) for g in GROUPS}
    for f in PLAN_FLAGS:
        if f.dest in omit:
            continue
        kw: dict[str, Any] = {"dest": f.dest, "help": f.help,
                              "default": defaults.get(f.dest)}
        if f.boolean:
            kw["action"] = argparse.BooleanOptionalAction
        elif f.dest in several:
            kw.update(type=values(f.type, f.choices), nargs="+", action=_Several,
                      metavar=f.metavar or "A,B")
        else:
            kw["type"] = f.type
            if f.dest == "recompute_modules":        # one list: --recompute-modules a,b
                kw["type"] = values(str, RECOMPUTE_MODULES)
            if f.choices is not None:
                kw["choices"] = f.choices
            if f.metavar is not None:
                kw["metavar"] = f.metavar
        groups[f.group].add_argument(f.flag, *f.aliases, **kw)


def given_dests(parser: argparse.ArgumentParser, argv: Sequence[str],
                dests: Iterable[str] = DESTS) -> set[str]:
    """Which of ``dests`` (default: the table's) ``argv`` sets on ``parser`` (a command's own
    parser; abbreviated and ``--flag=value`` forms included), as opposed to those left at
    their defaults: what overrides a plan file. argparse fills in a default only where the
    namespace has no value yet, so a namespace of sentinels shows what the line gave (flags
    ``parser`` does not know are left to another parser)."""
    unset = object()
    dests = list(dests)
    ns, _ = parser.parse_known_args(list(argv),
                                    namespace=argparse.Namespace(**{k: unset for k in dests}))
    return {k for k in dests if getattr(ns, k, unset) is not unset}


def model_from_flags(ns: argparse.Namespace, given: set[str], base: ModelSpec) -> ModelSpec:
    """``base`` (or ``--model``'s model) with the given model-shape flags applied."""
    model = base
    if "model" in given and getattr(ns, "model", None) is not None:
        model = load_model(ns.model)
    changes = {BY_DEST[d].name: getattr(ns, d) for d in given
               if d in BY_DEST and BY_DEST[d].group == "model" and d != "model"
               and getattr(ns, d) is not None}
    if changes:
        try:
            model = model.with_(**changes)
        except (TypeError, PlanError) as exc:
            raise PlanError(f"model: {exc}") from None
    return model


def load_model(name: "str | Path") -> ModelSpec:
    """A preset, a Hugging Face config.json, or a directory holding one."""
    path = Path(str(name))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PlanError(f"--model {name}: the directory holds no config.json")
        return get_model(path / "config.json")
    return get_model(name)


def apply_flags(plan: Any, ns: argparse.Namespace, given: set[str]) -> Any:
    """``plan`` (a `pipesim.Plan`) with every table flag ``given`` on the command line applied:
    the flags override the plan's fields. The global batch follows ``--microbatches`` (with the
    plan's or the given micro-batch size and dp) unless ``--global-batch-size`` is given."""
    par = plan.parallelism
    model = model_from_flags(ns, given, plan.model)
    changes: dict[str, Any] = {}
    for dest in given:
        f = BY_DEST.get(dest)
        if f is None or not f.field.startswith("parallelism."):
            continue
        value = getattr(ns, dest)
        if value is None:
            continue
        changes[f.name] = value
    if "microbatches" in given and ns.microbatches is not None:
        if "global_batch_size" in given and ns.global_batch_size is not None:
            raise PlanError("give --microbatches or --global-batch-size, not both (the global "
                            "batch is microbatches x micro-batch-size x dp)")
        if ns.microbatches < 1:
            raise PlanError(f"--microbatches must be >= 1, got {ns.microbatches}")
        mbs = changes.get("micro_batch_size", par.micro_batch_size)
        dp = changes.get("dp", par.dp)
        changes["global_batch_size"] = ns.microbatches * mbs * dp
    try:
        out = plan.with_(**changes)
    except (TypeError, ValueError) as exc:
        raise PlanError(str(exc)) from None
    if model is not plan.model:
        out = out.with_(model=model)
    return out
