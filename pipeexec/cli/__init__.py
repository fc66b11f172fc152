"""The command lines: ``pipeexec train`` (`train`), ``pipeexec compare`` (`compare`),
``pipeexec checkpoint inspect|convert`` (`checkpoint`), the profiling flags they share
(`profile_flags`) and the entry point that dispatches to them (`main`)."""
from __future__ import annotations

from .main import main

__all__ = ["main"]
