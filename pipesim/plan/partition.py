"""Which transformer layers each pipeline stage holds.

Even (the first ``layers % stages`` stages take one more; `even_split`: the one rule of pipesim
and pipeexec; with fewer layers than stages the embedding and the loss count as layers), or Megatron-LM's options:
``first_stage_layers`` / ``last_stage_layers`` (``--decoder-first-pipeline-num-layers`` /
``--decoder-last-pipeline-num-layers``: the first and last virtual stage get that many, the
others share the rest evenly), and ``account_for_embedding`` / ``account_for_loss``
(``--account-for-embedding-in-pipeline-split`` / ``...-loss-in-...``: the embedding, or the
head and loss, counts as one layer when splitting, so the first / last stage takes one layer
fewer). Megatron's layout string (``--pipeline-model-parallel-layout``, e.g.
``"Et*4|(t*4|)*14tmL"``: stages split by ``|``, ``E`` embedding, ``t`` a transformer layer,
``m`` a multi-token-prediction module (on the last stage, where pipesim places them), ``L``
the loss, ``X*n`` and ``(...)*n`` repeat, commas are cosmetic) or an explicit list of layers
per stage override all of these.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

from ..errors import PlanError


def even_split(total: int, parts: int) -> list[int]:
    """``total`` layers over ``parts`` stages as evenly as possible, the first ``total % parts``
    stages one more: the one even-split rule of pipesim and pipeexec. Megatron-LM has none for
    an uneven count (it asks for divisibility, or first/last-stage counts, or the embedding and
    loss accounted as layers: `stage_layers`); DeepSpeed's ``partition_uniform`` gives the
    remainder to the first stages, as this does, and the planner's costs assume it."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def stage_layers(layers: int, num_stages: int, *, explicit: Sequence[int] | None = None,
                 first: int | None = None, last: int | None = None,
                 account_for_embedding: bool = False, account_for_loss: bool = False) -> list[int]:
    """Layers of each of ``num_stages`` stages; raise PlanError naming the field and rule."""
    if explicit is not None:
        counts = [int(x) for x in explicit]
        if len(counts) != num_stages:
            raise PlanError(f"partition: {len(counts)} entries, expected pp * vpp = {num_stages}")
        if any(c < 0 for c in counts) or sum(counts) != layers:
            raise PlanError(f"partition: layers per stage {counts} must be >= 0 and sum to the "
                            f"model's {layers} layers (they sum to {sum(counts)})")
    elif first is not None or last is not None:
        if account_for_embedding or account_for_loss:
            raise PlanError("partition: first/last_stage_layers and account_for_embedding/loss "
                            "exclude each other (as in Megatron-LM)")
        fixed = (first or 0) + (last or 0)
        middle = num_stages - (first is not None) - (last is not None)
        rest = layers - fixed
        if rest < 0 or (middle == 0 and rest != 0) or (middle > 0 and rest < middle):
            raise PlanError(f"partition: first_stage_layers={first}, last_stage_layers={last} "
                            f"leave {rest} of {layers} layers for {middle} other stage(s); each "
                            "needs at least one")
        counts = even_split(rest, middle) if middle else []
        if first is not None:
            counts.insert(0, first)
        if last is not None:
            counts.append(last)
    else:
        if layers < num_stages and not (account_for_embedding or account_for_loss):
            # fewer blocks than stages: the embedding and the loss count as layers, as
            # Megatron's account-for options make them (the first and last stage may hold the
            # embedding or the head alone), the only even cut there is
            account_for_embedding = account_for_loss = True
        extra = int(account_for_embedding) + int(account_for_loss)
        if layers + extra < num_stages:
            raise PlanError(f"partition: the model has {layers} layers, fewer than pp * vpp = "
                            f"{num_stages} stages")
        counts = even_split(layers + extra, num_stages)
        if account_for_embedding:
            counts[0] -= 1
        if account_for_loss:
            counts[-1] -= 1
        if min(counts) < 0:
            raise PlanError(f"partition: {layers} layers with the embedding/loss accounted for "
                            f"cannot fill {num_stages} stages")
    for stage, c in enumerate(counts):
        holds_other = (stage == 0) or (stage == num_stages - 1)
        if c == 0 and not holds_other:
            raise PlanError(f"partition: stage {stage} holds no layer (layers per stage {counts})")
    return counts


_GROUP = re.compile(r"\(([^()]+)\)\*(\d+)")
_SINGLE = re.compile(r"(.)\*(\d+)")


def parse_layout(layout: str, layers: int, num_stages: int,
                 mtp_layers: int | None = None) -> list[int]:
    """Transformer layers per stage from Megatron's layout string (the format of
    megatron/core/transformer/pipeline_parallel_layer_layout.py ``parse_str_to_list``);
    PlanError naming ``partition_layout`` and the rule broken. Multi-token-prediction modules
    (``m``) go on the last stage with the loss, where pipesim places them (Megatron-Bridge's
    DeepSeek-V3 layouts: ``...|t*4|tmL``); ``mtp_layers``: the model's, checked if given."""
    text = str(layout).replace(",", "")
    text = _GROUP.sub(lambda m: m.group(1) * int(m.group(2)), text)
    text = _SINGLE.sub(lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    bad = sorted(set(text) - set("ELt|m"))
    if bad:
        raise PlanError(f"partition_layout: unknown layer character(s) {''.join(bad)!r} in "
                        f"{layout!r}; known: E (embedding), t (transformer layer), m (MTP), "
                        "L (loss)")
    if "m" in "".join(stages[:-1]):
        raise PlanError("partition_layout: MTP layers ('m') are modelled on the last stage only, "
                        f"with the loss ({layout!r})")
    if mtp_layers is not None and stages[-1].count("m") not in (0, mtp_layers):
        raise PlanError(f"partition_layout: {stages[-1].count('m')} MTP layers ('m') in "
                        f"{layout!r}, the model has {mtp_layers}")
    if len(stages) != num_stages:
        raise PlanError(f"partition_layout: {layout!r} has {len(stages)} stages, the plan "
                        f"pp * vpp = {num_stages}")
    flat = text.replace("|", "")
    if not flat.startswith("E") or flat.count("E") != 1:
        raise PlanError(f"partition_layout: the embedding 'E' must come once, first ({layout!r})")
    if not flat.endswith("L") or flat.count("L") != 1:
        raise PlanError(f"partition_layout: the loss 'L' must come once, last ({layout!r})")
    counts = [st.count("t") for st in stages]
    if sum(counts) != layers:
        raise PlanError(f"partition_layout: {sum(counts)} transformer layers in {layout!r}, the "
                        f"model has {layers}")
    return counts
