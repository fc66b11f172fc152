"""`ConfigError`, in a module of its own: the config, the plan checks (`pipeexec.refusals`) and
the models (`pipeexec.models`) all raise it, and the config imports those checks, so the error
cannot live in the config without an import circle. ``pipeexec.config.ConfigError`` is it."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run, with the field and the reason."""
