"""The ``tddist`` command: list, inspect, compare, verify, clean and convert checkpoints.

One module per command (``tddist/cli/<command>.py``), each with
``register(subparsers)``; only the module of the command that runs is
imported, so ``tddist --version`` and ``tddist --help`` import no command
module (neither numpy nor the manifest code), and the light commands
(``ls``, ``latest``, ``info``) never import torch: manifests are JSON. Exit
status: 0 ok, 1 a problem was found (or an error), 2 a usage error, 130
interrupted, 141 the output pipe was closed (as for other Unix tools).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Iterable

from .._version import __version__
from ..errors import TddistError

#: Exit statuses (docs/cli.md).
EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_PIPE = 141

#: Every command, in the order ``tddist --help`` lists them: its module (``tddist/cli/<module>.py``) and its
#: one-line help, the same as the module registers (tests/test_cli.py checks that they agree), so that the
#: list needs none of the modules imported.
COMMANDS: dict[str, tuple[str, str]] = {
    "ls": ("ls", "list the checkpoints under a directory or s3:// prefix, with leftovers of interrupted saves"),
    "latest": ("latest", "print the newest committed checkpoint under a directory or s3:// prefix (for scripts)"),
    "info": ("info", "describe a checkpoint: contents, sizes, metadata, non-tensor values (reads only the manifest)"),
    "diff": ("diff", "compare two checkpoints: keys, dtypes, shapes, placements, values and content"),
    "verify": ("verify", "check every chunk of a checkpoint (sizes, structure and checksums) and list every problem"),
    "gc": ("gc", "remove leftovers of interrupted saves and old checkpoints under a root, as the manager does"),
    "recover": ("recover", "remove leftovers of interrupted saves beside a checkpoint (or restore its backup)"),
    "pack": ("pack", "pack a directory checkpoint into one .tdz archive"),
    "unpack": ("pack", "unpack a .tdz archive into a directory checkpoint"),
    "materialize": ("pack", "copy a checkpoint with the chunks it references into a self-contained directory"),
    "convert": ("convert", "convert between tddist, DCP, torch.save and safetensors checkpoints"),
}
#: The commands that take an ``s3://`` path (the others work on files).
_ON_OBJECT_STORAGE = ("ls", "latest", "info", "gc", "recover", "verify", "materialize")

EPILOG = """\
exit status: 0 ok; 1 a problem was found (a bad chunk, no checkpoint, a difference) or an error;
2 wrong usage; 130 interrupted; 141 the output pipe was closed.
Every command that reports takes --json: one JSON object on stdout, described in docs/cli.md.
Run 'tddist COMMAND --help' for a command's options."""


def parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser of the ``tddist`` command (also used to generate docs/cli.md's reference).

    Args:
        commands: the commands whose modules are imported to register their
            options (None: all of them). The others are registered by name and
            one-line help only: enough for ``tddist --help``, ``--version`` and
            telling a mistyped command, without importing their modules.
    """
    modules = {COMMANDS[name][0] for name in (COMMANDS if commands is None else commands)}
    p = argparse.ArgumentParser(
        prog="tddist",
        description="Inspect and maintain tddist checkpoints (directories and .tdz archives).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"tddist {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        if name in sub.choices:  # registered with another command of its module (unpack with pack)
            continue
        if module in modules:
            importlib.import_module(f"{__name__}.{module}").register(sub)
        else:
            sub.add_parser(name, help=help_)
    return p


def _command_in(argv: list[str]) -> list[str]:
    """The command named in ``argv`` (its first word that is not an option), if it is one; else none.

    The options before a command (``--help``, ``--version``) take no value,
    so the first other word is the command.
    """
    word = next((a for a in argv if not (isinstance(a, str) and a.startswith("-"))), None)
    return [word] if isinstance(word, str) and word in COMMANDS else []


class _LogHandler(logging.Handler):
    """The library's warnings on stderr, one line each (the library itself never prints)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(f"tddist: {record.levelname.lower()}: {record.getMessage()}\n")
        except Exception:  # a closed stderr must not turn into a traceback
            pass


def main(argv: list[str] | None = None) -> int:
    """Run the ``tddist`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser(_command_in(argv)).parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors
        _flush_quietly()
        return int(e.code or 0) if isinstance(e.code, int) else EXIT_USAGE
    except BrokenPipeError:
        return _closed_pipe()
    log = logging.getLogger("tddist")
    handler = _LogHandler(logging.WARNING)
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    remote = [v for v in vars(args).values() if isinstance(v, str) and v.startswith("s3://")]
    if remote and args.command not in _ON_OBJECT_STORAGE:
        sys.stderr.write(
            f"tddist {args.command}: {remote[0]} is on object storage, which only 'tddist ls', 'tddist latest', "
            f"'tddist info', 'tddist gc', 'tddist recover', 'tddist verify' and 'tddist materialize' (from it) "
            f"support; copy it with 'tddist materialize' first\n"
        )
        return EXIT_PROBLEM
    try:
        status = args.run(args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        return _closed_pipe()
    except KeyboardInterrupt:
        sys.stderr.write("tddist: interrupted\n")
        return EXIT_INTERRUPTED
    except (TddistError, OSError) as e:
        return _error(args, e)
    finally:
        log.removeHandler(handler)


def _error(args: argparse.Namespace, e: BaseException) -> int:
    if isinstance(e, OSError) and not isinstance(e, TddistError):
        message = f"{e.strerror or e}" + (f": {e.filename!r}" if e.filename else "")
    else:
        message = str(e)
    try:
        if getattr(args, "json", False):
            doc = {"schema": "tddist.error/1", "command": args.command, "error": type(e).__name__, "message": message}
            sys.stdout.write(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
            sys.stdout.flush()
        sys.stderr.write(f"tddist {args.command}: {message}\n")
    except BrokenPipeError:
        return _closed_pipe()
    return EXIT_PROBLEM


def _flush_quietly() -> None:
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _closed_pipe()


def _closed_pipe() -> int:
    """The reader of our output went away (``tddist ls | head``): stop quietly.

    stdout is pointed at /dev/null so that the interpreter's final flush
    cannot raise again at exit.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return EXIT_PIPE
