"""Checkpointing: complete, crash-safe, exactly resumable, loadable into any layout.

Megatron-LM's layout (``latest_checkpointed_iteration.txt``,
``iter_XXXXXXX/mp_rank_00_PPP/model_optim_rng.pt``), every entry keyed by global layer index and
parameter name. Modules: `layout` (paths), `atomic` (crash-safe writes), `tracker`, `contents`
(what a file holds), `rng`, `sync` (barrier), `save`, `reader`, `load`, `convert`, `inspect`,
`manager` (flags and the training-loop hooks), `cli`.
"""
from .convert import ConvertReport, convert_checkpoint
from .errors import CheckpointError
from .inspect import describe
from .layout import CHECKPOINT_VERSION, RELEASE, state_file, tag_dir, tracker_path
from .load import LoadReport, load_checkpoint
from .manager import FAULT_ENV, CheckpointManager, CheckpointOptions
from .reader import CheckpointReader, read_state_file, verify_file
from .save import SaveReport, prune, save_checkpoint
from .tracker import read_tracker, write_tracker

__all__ = [
    "CHECKPOINT_VERSION", "RELEASE", "FAULT_ENV", "CheckpointError", "CheckpointManager",
    "CheckpointOptions", "CheckpointReader", "ConvertReport", "LoadReport", "SaveReport",
    "convert_checkpoint", "describe", "load_checkpoint", "prune", "read_state_file",
    "read_tracker", "save_checkpoint", "state_file", "tag_dir", "tracker_path", "verify_file",
    "write_tracker",
]
