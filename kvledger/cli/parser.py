"""The argument parser and the logging setup of every kvledger command.

A bad argument is one line on stderr naming it (argparse's default prints the whole usage first,
which buries the error), and exit status 2. Help shows each option's default. Diagnostics
(progress, warnings) go through `logging` to stderr; results stay on stdout."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from kvledger.engine.options import EngineOptionError

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_LEVEL = "info"  # kvledger's progress messages (fuzz, zoo, minimize) are INFO: shown unless -q


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help, unless the help already speaks of its default or
    X says nothing: None (the help says what it means), a flag's own False/True, a suppressed default.
    Unlike ArgumentDefaultsHelpFormatter it also shows the default of an option without help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text.lower()
            or default is None
            or default is argparse.SUPPRESS
            or action.nargs == 0
            or not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._get_help_string(action):
            import copy

            action = copy.copy(action)  # argparse prints no help column for an action without help
            action.help = self._get_help_string(action)
        return super()._format_action(action)


class OneLineErrorParser(argparse.ArgumentParser):
    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)  # subparsers get it too
        super().__init__(**kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def option_error(prog: str, err: EngineOptionError) -> int:
    """Print err as one line naming the flag ("kvledger generate: --page-size must be at least 1,
    got 0") on stderr; return the exit status 2."""
    from kvledger.engine.engine_config import EngineConfig

    print(f"{prog}: {EngineConfig.flag(err.option)} {err.problem}", file=sys.stderr)
    return 2


def add_logging_options(p: argparse.ArgumentParser) -> None:
    """--log-level and -q/--quiet. Their defaults are suppressed so that the same options on a
    subcommand do not overwrite what was given before it: `kvledger -q fuzz` and `kvledger fuzz -q`
    both work; `log_level(args)` reads the result."""
    g = p.add_argument_group("logging (diagnostics on stderr; results stay on stdout)")
    g.add_argument(
        "--log-level",
        dest="log_level",
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS,
        help=f"level of kvledger's messages (default: {DEFAULT_LOG_LEVEL}: progress shown; "
        "other libraries' messages: warning and above)",
    )
    g.add_argument(
        "-q",
        "--quiet",
        dest="log_level",
        action="store_const",
        const="warning",
        default=argparse.SUPPRESS,
        help="warnings and errors only, no progress (--log-level warning)",
    )


def log_level(args: argparse.Namespace) -> str:
    return getattr(args, "log_level", None) or DEFAULT_LOG_LEVEL


def configure_logging(level: str = DEFAULT_LOG_LEVEL) -> None:
    """Once per command: a stderr handler on the root logger (unless one is there already: pytest's,
    an embedding program's); kvledger's loggers at `level`, every other library's at WARNING.
    Progress (INFO) prints as bare lines, other levels name themselves ("warning: ...")."""
    import logging  # not at import time: `kvledger --help` stays fast

    class LevelNamingFormatter(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            text = super().format(record)
            return text if record.levelno == logging.INFO else f"{record.levelname.lower()}: {text}"

    if not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(LevelNamingFormatter("%(message)s"))
        logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("kvledger").setLevel(level.upper())
