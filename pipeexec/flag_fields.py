"""Option values whose fields carry their command-line flags, so a value and its CLI cannot
drift: `option` declares a field with its help and argparse settings, `add_arguments` adds one
flag per such field (its default the field's), `values_from_args` reads them back.

Used by `TrainConfig`'s sections, `CheckpointOptions` and `ProfileOptions`. Torch-free.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import field
from typing import Any


def option(default: Any, help: str, *, flag: str | None = "", **cli: Any) -> Any:
    """A dataclass field with its flag: ``help`` (shown with the default), ``flag`` (default
    ``--field-name``; None: no flag), argparse settings in ``cli`` (``type``, ``choices``,
    ``metavar``, ``action``); ``parse``: text -> value after argparse; ``invert``: a
    store_true flag that sets the field to False; ``fields``: the names of the fields one flag
    sets (its parsed value a tuple of as many values, e.g. ``--profile A:B`` -> first, stop;
    the flag's default is None: not given, the fields are left out of `values_from_args`).
    ``default`` may be a zero-argument callable marked ``factory=True`` in ``cli``."""
    factory = cli.pop("factory", False)
    meta = {"help": help, "flag": flag, "cli": cli}
    if factory:
        return field(default_factory=default, metadata=meta)
    if default == ():
        return field(default_factory=tuple, metadata=meta)
    return field(default=default, metadata=meta)


def flagged(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that have a flag, in declaration order."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flag") is not None]


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def dest_of(f: dataclasses.Field) -> str:
    return flag_of(f).lstrip("-").replace("-", "_")


def add_arguments(parser: Any, cls: type, defaults: Any = None) -> None:
    """One flag per flagged field of ``cls`` on ``parser`` (a parser or an argument group);
    defaults from ``defaults`` (an instance; default ``cls()``)."""
    d = cls() if defaults is None else defaults
    for f in flagged(cls):
        cli = dict(f.metadata["cli"])
        cli.pop("parse", None)
        cli.pop("invert", None)
        several = cli.pop("fields", None)
        kw: dict[str, Any] = {"help": f.metadata["help"], "dest": dest_of(f), **cli}
        if several:
            kw["default"] = None
        elif kw.get("action") == "append":
            kw["default"] = []
        elif kw.get("action") == "store_true":
            kw["default"] = False
        else:
            kw["default"] = getattr(d, f.name)
        parser.add_argument(flag_of(f), **kw)


def values_from_args(cls: type, ns: argparse.Namespace) -> dict[str, Any]:
    """Field -> value for every flagged field of ``cls``, read from ``ns`` (a flag that sets
    several ``fields``: those fields, when the flag was given)."""
    out: dict[str, Any] = {}
    for f in flagged(cls):
        cli = f.metadata["cli"]
        value = getattr(ns, dest_of(f))
        if cli.get("fields"):
            if value is not None:
                parsed = cli["parse"](value) if "parse" in cli else value
                out.update(zip(cli["fields"], parsed))
            continue
        if cli.get("invert"):
            value = not value
        if "parse" in cli:
            value = cli["parse"](value)
        if cli.get("action") == "append":
            value = tuple(value)
        out[f.name] = value
    return out
