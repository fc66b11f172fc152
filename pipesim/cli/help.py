"""Help text shared by the ``pipesim`` and ``pipeexec`` command lines: every flag shows its
default, and ``--version`` says which package (and torch, for pipeexec) answers."""
from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to a flag's help when it has a meaningful default: not for
    ``None`` (the help says what happens then), ``False`` switches, or help that already names
    its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS
                or default == [] or "default" in text or not action.option_strings):
            return text
        return super()._get_help_string(action)


def package_version(dist: str = "pipesim") -> str:
    """The installed distribution's version (``unknown`` when run from an uninstalled tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


class VersionAction(argparse.Action):
    """``--version``: print ``version_text()`` (computed only when asked) and exit."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 version_text=None, help="print the version and exit"):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)
        self.version_text = version_text

    def __call__(self, parser, namespace, values, option_string=None):
        print(self.version_text())
        parser.exit()
