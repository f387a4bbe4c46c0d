"""The --help layout every pdserve command shares."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the descriptions' line breaks; appends a default that says something (not None or False)
    to each flag whose help does not already name its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text.lower() or action.default in (None, False, "", [], ())
                or action.default == argparse.SUPPRESS or action.option_strings == []):
            return text
        default = (" ".join(map(str, action.default)) if isinstance(action.default, (list, tuple))
                   else "%(default)s")
        return f"{text} (default: {default})" if text else f"default: {default}"
