"""Every command's --help says what each flag defaults to (a new-user check: `up`'s --port and its pool
sizes, `proxy`'s --timeout and `serve`'s queue and block size did not, and --host/--port had no text)."""
import contextlib
import io

import pytest

from pdserve import cli


def help_text(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main([command, "--help"])
    return " ".join(out.getvalue().split())   # argparse wraps lines


@pytest.mark.parametrize("command, shown", [
    ("up", ["--port PORT the router's port; instances take the next ones (on Ray: free ports of their nodes) "
            "(default: 8000)", "(default: 1)"]),
    ("proxy", ["port of the router's OpenAI-compatible API (default: 8000)", "(default: 600"]),
    ("serve", ["port of the OpenAI-compatible API (default: 8000)", "tokens per KV block (default: 16)",
               "address to listen on"]),
])
def test_help_shows_defaults(command, shown):
    text = help_text(command)
    for piece in shown:
        assert piece in text, piece
    assert "(default: None)" not in text and "(default: False)" not in text


def test_the_top_level_help_loads_no_torch():
    """`pdserve --help` took 2.7 s: listing kv-store's flags imported the store's server, torch and NIXL."""
    import subprocess
    import sys
    code = ("import contextlib, io, sys\nfrom pdserve import cli\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    cli.main(['--help'])\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.strip() == "False"


def test_empty_and_already_given_defaults_are_not_shown_again():
    """`(default: )` after empty lists and strings, `(default: (512,))` for a tuple, and "Default: X
    (default: X)" where the help named it with a capital (review)."""
    for command in ("up", "proxy", "serve", "plan"):
        text = help_text(command)
        assert "(default: )" not in text and "(default: (" not in text, command
        assert "(default: round-robin)" not in text, command   # --policy's help says "Default: ..."
