"""``pipeexec checkpoint export-hf CKPT OUT_DIR [--iteration N] [--force]``: the command line
of `pipeexec.checkpoint.export_hf` (mounted under ``pipeexec checkpoint``)."""
from __future__ import annotations

import argparse
from collections.abc import Callable

from pipesim.units import bytes_arg

from ..checkpoint.errors import CheckpointError
from ..checkpoint.layout import RELEASE

EXPORT_HELP = ("write a checkpoint of any layout as a Hugging Face model directory "
               "(config.json, model.safetensors) for AutoModelForCausalLM.from_pretrained "
               "and --hf-model")


def add_export_command(sub, fmt: type, tag: Callable[[str], object]) -> None:
    e = sub.add_parser("export-hf", help=EXPORT_HELP, description=EXPORT_HELP,
                       formatter_class=fmt)
    e.add_argument("ckpt", help="the checkpoint directory (a --save directory)")
    e.add_argument("out_dir", help="the Hugging Face model directory to write (must not exist "
                   "unless --force)")
    e.add_argument("--iteration", type=tag, default=None,
                   help=f"an iteration number or {RELEASE!r} (default: the tracker's)")
    e.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    e.add_argument("--max-shard-size", type=bytes_arg, default=None, metavar="BYTES",
                   help="largest safetensors file (e.g. 2GB); above it the weights are "
                   "sharded with model.safetensors.index.json (default 5GiB)")
    e.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the written tensors' type (the checkpoint's fp32 weights, rounded)")


def run_export(ns: argparse.Namespace, log: Callable[[str], None]) -> None:
    from ..checkpoint.export_hf import DEFAULT_MAX_SHARD_BYTES, export_hf

    size = DEFAULT_MAX_SHARD_BYTES if ns.max_shard_size is None else ns.max_shard_size
    if size != int(size) or size < 1:
        raise CheckpointError(f"--max-shard-size must be a positive whole number of bytes, "
                              f"got {ns.max_shard_size!r}")
    export_hf(ns.ckpt, ns.out_dir, tag=ns.iteration, force=ns.force,
              max_shard_bytes=int(size), dtype=ns.dtype, log=log)
