"""Training data from tokenized corpora: Megatron's indexed datasets, read and written.

* `indexed`: ``PREFIX.bin`` / ``PREFIX.idx`` (Megatron-Core's format, memory-mapped).
* `preprocess`: ``pipeexec preprocess-data``, a corpus tokenized into one.
* `tokenizer`: a Hugging Face tokenizer from a local folder.
* `gpt`, `blend`, `split`: Megatron's GPTDataset samples, weighted blending, train /
  validation / test split by document.
* `build`: what a run's ``--data-path`` and ``--split`` give.

For the code that trains or evaluates::

    from pipeexec.datasets import build_datasets
    train, valid, test = build_datasets(config, valid_samples=None, test_samples=None)

Each of the three has ``len(ds)`` and ``ds[i] -> np.ndarray`` of ``seq_len + 1`` token ids
(int64): inputs ``ds[i][:-1]``, targets ``ds[i][1:]``. ``train`` holds at least ``config.steps
* config.global_batch`` samples and step ``k`` trains on samples ``k * global_batch ..
(k + 1) * global_batch - 1`` (``consumed_samples``, what checkpoints store). ``valid`` and
``test`` hold ``*_samples`` samples (None: one epoch of each corpus's split); a split with no
documents (share 0, or too few tokens for one sample) has length 0. ``build_dataset(config,
"validation", num_samples)`` builds one split alone. `check_split_for_eval` refuses an empty
validation split before a run that evaluates. Torch-free (numpy).
"""
from __future__ import annotations

from .build import DataPathError, EmptySamples, build_dataset, build_datasets, \
    check_data_path, check_split_for_eval

__all__ = ["DataPathError", "EmptySamples", "build_dataset", "build_datasets", "check_data_path",
           "check_split_for_eval"]
