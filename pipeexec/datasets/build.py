"""The train, validation and test samples of a run's ``--data-path``, and the checks that run
before any process starts."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .blend import SURPLUS, BlendedSamples, BlendError, fitting_size, normalize, \
    parse_data_path, target_sizes
from .gpt import GPTSamples, epoch_plan
from .indexed import IndexedDataset, IndexedDatasetError
from .split import SPLITS, SplitError, parse_split, split_ranges


class DataPathError(ValueError):
    """A ``--data-path`` / ``--split`` that cannot be read, naming the item and the reason."""


class EmptySamples:
    """A split with no samples (share 0, or too few tokens for one sample)."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __len__(self) -> int:
        return 0

    def __getitem__(self, i: int) -> np.ndarray:
        raise IndexError(f"the split has no samples: {self.why}")


@dataclass(frozen=True)
class DataPlan:
    """What ``--data-path`` and ``--split`` spell: the corpora (prefix, normalised weight;
    weight-0 corpora dropped), the split shares, and each corpus's document ranges per split."""

    prefixes: tuple[str, ...]
    weights: tuple[float, ...] | None
    shares: tuple[float, float, float]
    ranges: tuple[tuple[tuple[int, int] | None, ...], ...]     # [corpus][split]
    tokens: tuple[tuple[int, int, int], ...]                    # [corpus][split]


def data_plan(data_path: Sequence[str], split: str) -> DataPlan:
    """Parse and check ``--data-path`` and ``--split``, open every corpus's index (O(1) checks
    of the files: header, sizes) and count each split's tokens. DataPathError names the item."""
    try:
        prefixes, weights = parse_data_path(data_path)
        shares = parse_split(split)
    except (BlendError, SplitError) as exc:
        raise DataPathError(str(exc)) from None
    if weights is not None:
        kept = [(p, w) for p, w in zip(prefixes, weights) if w > 0]
        for p in prefixes:                  # a weight-0 corpus must still be a corpus
            _open(p)
        prefixes = tuple(p for p, _ in kept)
        weights = tuple(normalize([w for _, w in kept]))
    ranges, tokens = [], []
    for p in prefixes:
        ds = _open(p)
        r = split_ranges(shares, len(ds))
        ranges.append(r)
        tokens.append(tuple(0 if rng is None else
                            int(ds.sequence_lengths[rng[0]:rng[1]].astype(np.int64).sum())
                            for rng in r))
    return DataPlan(prefixes, weights, shares, tuple(ranges), tuple(tokens))  # type: ignore[arg-type]


def _open(prefix: str) -> IndexedDataset:
    try:
        return IndexedDataset(prefix)
    except IndexedDatasetError as exc:
        raise DataPathError(f"--data-path: {exc}") from None


def check_data_path(data_path: Sequence[str], split: str, seq_len: int) -> DataPlan:
    """Everything about the data that can be refused before a run: the items, the files, the
    split, and a train split of every corpus holding at least one sample."""
    plan = data_plan(data_path, split)
    for p, t in zip(plan.prefixes, plan.tokens):
        if t[0] < seq_len + 1:
            raise DataPathError(
                f"--data-path {p}: its train split ({plan.shares[0]:.3g} of its documents, "
                f"--split {split}) holds {t[0]} tokens, fewer than one sample of seq_len + 1 = "
                f"{seq_len + 1}")
    return plan


def check_split_for_eval(data_path: Sequence[str], split: str, seq_len: int,
                         flag: str = "--eval-interval") -> None:
    """Refuse a run that evaluates (``flag`` set) on a validation split with no samples: a
    share of 0, or documents too few for one sample in some corpus."""
    plan = data_plan(data_path, split)
    for p, r, t in zip(plan.prefixes, plan.ranges, plan.tokens):
        if r[1] is None or t[1] < seq_len + 1:
            where = ("its share is 0" if r[1] is None else
                     f"documents {r[1][0]}..{r[1][1]} hold {t[1]} tokens, fewer than one sample "
                     f"of seq_len + 1 = {seq_len + 1}")
            raise DataPathError(f"{flag} evaluates on the validation split, which is empty for "
                                f"{p} (--split {split}: {where}); give validation a larger "
                                f"share, e.g. --split 98,2,0, or drop {flag}")


def build_split(plan: DataPlan, index: int, *, seq_len: int, seed: int,
                num_samples: int | None) -> Any:
    """The samples of split ``index`` (0 train, 1 validation, 2 test) over every corpus of
    ``plan``: one corpus's `GPTSamples`, a `BlendedSamples`, or `EmptySamples`."""
    name = SPLITS[index]
    empty = [p for p, r, t in zip(plan.prefixes, plan.ranges, plan.tokens)
             if r[index] is None or t[index] < seq_len + 1]
    if empty:
        return EmptySamples(f"the {name} split of {', '.join(empty)} holds no sample")
    docs = [np.arange(*r[index], dtype=np.int32) for r in plan.ranges]
    if plan.weights is None and len(plan.prefixes) == 1:
        return GPTSamples(IndexedDataset(plan.prefixes[0]), docs[0], seq_len=seq_len,
                          num_samples=num_samples, seed=seed)
    weights = plan.weights
    if weights is None:          # prefixes alone: weighted by their tokens in this split
        weights = tuple(normalize([t[index] for t in plan.tokens]))
    if num_samples is None:      # one epoch of each, as long as the weights allow
        parts = [GPTSamples(IndexedDataset(p), d, seq_len=seq_len, num_samples=None, seed=seed)
                 for p, d in zip(plan.prefixes, docs)]
        return BlendedSamples(parts, weights, fitting_size(weights, [len(x) for x in parts]))
    sizes = target_sizes(weights, num_samples, SURPLUS)
    parts = [GPTSamples(IndexedDataset(p), d, seq_len=seq_len, num_samples=n, seed=seed)
             for p, d, n in zip(plan.prefixes, docs, sizes)]
    return BlendedSamples(parts, weights, sum(target_sizes(weights, num_samples)))


def build_datasets(config: Any, *, valid_samples: int | None = None,
                   test_samples: int | None = None) -> tuple[Any, Any, Any]:
    """(train, valid, test) of ``config.data_path``: each has ``len`` and ``ds[i]``, the
    ``seq_len + 1`` token ids of sample ``i`` (int64). Train is built for the run's planned
    length (`train_samples`); valid and test for ``*_samples`` (None: one epoch of each
    corpus's split)."""
    plan = _checked(config)
    kw = dict(seq_len=config.plan.model.seq_length, seed=config.runtime.seed)
    return (build_split(plan, 0, num_samples=train_samples(config), **kw),
            build_split(plan, 1, num_samples=valid_samples, **kw),
            build_split(plan, 2, num_samples=test_samples, **kw))


def build_dataset(config: Any, split: str, num_samples: int | None = None) -> Any:
    """One split of `build_datasets` alone (``split``: "train", "validation" or "test"; train's
    ``num_samples`` is the run's, `train_samples`), for code that needs only that one."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    plan = _checked(config)
    index = SPLITS.index(split)
    return build_split(plan, index, seq_len=config.plan.model.seq_length, seed=config.runtime.seed,
                       num_samples=train_samples(config) if index == 0 else num_samples)


def train_samples(config: Any) -> int:
    """The train samples a run asks for, as Megatron's ``--train-iters x global batch``: the
    planned length, ``max(--steps, --decay-steps)`` iterations, so a run stopped early (a
    smaller --steps, --decay-steps fixed: the same LR curve) and resumed draws the samples
    the whole run draws (the epoch count, hence the shuffle, depends on this number)."""
    return max(config.optimizer.steps, config.optimizer.decay_steps or 0) * config.global_batch


def train_order(config: Any) -> tuple[tuple[int, bool], ...]:
    """Per corpus, (epochs, last epoch apart) of the train split: with the files, ``--split``,
    the seed and the sequence length, what fixes the order of the train samples (a blend's
    assignment does not depend on its length). Two runs with equal values draw the same
    samples at every step."""
    plan = _checked(config)
    n = train_samples(config)
    sizes = [n] if plan.weights is None and len(plan.prefixes) == 1 else target_sizes(
        plan.weights or normalize([t[0] for t in plan.tokens]), n, SURPLUS)
    seq_len = config.plan.model.seq_length
    return tuple(epoch_plan(t[0], seq_len, k) for t, k in zip(plan.tokens, sizes))


def _checked(config: Any) -> Any:
    """``config``'s ``--data-path`` and ``--split`` read and checked for its sequence length
    (`check_data_path`)."""
    return check_data_path(config.inputs.data_path, config.inputs.split,
                           config.plan.model.seq_length)
