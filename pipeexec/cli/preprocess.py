"""``pipeexec preprocess-data``: a corpus tokenized into Megatron's indexed dataset
(`pipeexec.datasets.preprocess`)."""
from __future__ import annotations

import argparse
import sys

from pipesim.cli.help import DefaultsHelpFormatter

PREPROCESS_HELP = ("tokenize a .jsonl or .txt corpus into a Megatron indexed dataset "
                   "(PREFIX.bin, PREFIX.idx) for train --data-path")


def add_command(subparsers) -> None:
    p = subparsers.add_parser("preprocess-data", help=PREPROCESS_HELP, description=PREPROCESS_HELP,
                              formatter_class=DefaultsHelpFormatter)
    a = p.add_argument
    a("--input", required=True, metavar="FILE",
      help="a .jsonl file (one JSON object a line) or a .txt file (documents separated by "
           "blank lines)")
    a("--tokenizer", required=True, metavar="DIR",
      help="a Hugging Face tokenizer folder (local; save_pretrained's tokenizer.json)")
    a("--output-prefix", required=True, metavar="PREFIX",
      help="write PREFIX.bin and PREFIX.idx (PREFIX_KEY.* for each of several --json-keys)")
    a("--json-keys", nargs="+", default=["text"], metavar="KEY",
      help="the .jsonl keys holding the text")
    a("--workers", type=int, default=1, help="tokenizer processes")
    a("--append-eod", action=argparse.BooleanOptionalAction, default=True,
      help="end every document with the tokenizer's eos token (Megatron's GPT recipe)")
    a("--force", action="store_true", help="replace existing output files")
    a("--no-progress", action="store_true", help="no progress bar")


def run(ns: argparse.Namespace) -> int:
    """Exit status: 0 written, 2 bad input."""
    from ..datasets.indexed import IndexedDatasetError
    from ..datasets.preprocess import PreprocessError, PreprocessOptions, preprocess
    from ..datasets.tokenizer import TokenizerError

    opts = PreprocessOptions(input=ns.input, tokenizer=ns.tokenizer,
                             output_prefix=ns.output_prefix, json_keys=tuple(ns.json_keys),
                             workers=ns.workers, append_eod=ns.append_eod, force=ns.force,
                             progress=not ns.no_progress)
    try:
        result = preprocess(opts)
    except (PreprocessError, TokenizerError, IndexedDatasetError) as exc:
        print(f"pipeexec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\npipeexec: interrupted (nothing written)", file=sys.stderr)
        return 130
    print(f"pipeexec: {result.documents} documents, {result.tokens} tokens -> "
          + ", ".join(f"{p}.bin/.idx" for p in result.outputs))
    return 0
