"""The `kvledger` command line: every option has help and shows its default, one spelling per idea
(-o/--output for a file, --out-dir for a directory, --overlap/--no-overlap), diagnostics through
logging on stderr (progress at INFO, shown unless -q), results on stdout."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys

import pytest

from kvledger.cli import build_parser, commands, main
from tests.support.paths import ROOT

TRACES = ROOT / "tests" / "zoo_traces"
COMMANDS = [name for name, _ in commands()]


def _subparsers():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return parser, sub.choices


@pytest.fixture
def kvledger_log_level():
    logger = logging.getLogger("kvledger")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_help_and_help_shows_defaults(command):
    _, sub = _subparsers()
    p = sub[command]
    assert all(a.help for a in p._actions), [a.dest for a in p._actions if not a.help]
    text = p.format_help()
    for a in p._actions:
        if a.option_strings and a.nargs != 0 and a.default not in (None, argparse.SUPPRESS):
            assert "default" in (a.help or "").lower() or f"(default: {a.default})" in " ".join(text.split()), a.dest


def test_the_subcommands_and_their_order():
    assert COMMANDS == [
        "check",
        "replay",
        "generate",
        "serve",
        "bench",
        "zoo",
        "fuzz",
        "explore",
        "minimize",
        "subjects",
        "show",
        "coverage",
        "mutation",
    ]
    assert list(_subparsers()[1]) == COMMANDS


def test_building_the_parser_imports_no_torch():  # `kvledger --help` stays fast
    code = "import sys, kvledger.cli; kvledger.cli.build_parser(); print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
    )
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_defaults_are_shown_in_help():
    _, sub = _subparsers()
    text = " ".join(sub["fuzz"].format_help().split())
    assert "(default: .kvledger/fuzz)" in text and "(default: 60.0)" in text and "(default: 1)" in text
    text = " ".join(sub["bench"].format_help().split())
    assert "(default: 256)" in text and "(default: engine)" in text


def test_bench_overlap_has_the_engine_shape():
    parser = build_parser()
    assert parser.parse_args(["bench"]).overlap is None  # the engine's choice
    assert parser.parse_args(["bench", "--overlap"]).overlap is True
    assert parser.parse_args(["bench", "--no-overlap"]).overlap is False
    from kvledger.cli.bench import nano_options as options_from_args

    for flags, want in (([], None), (["--overlap"], True), (["--no-overlap"], False)):
        args = parser.parse_args(["bench", "--workload", "nano-vllm", "-o", "x.json", *flags])
        opts = options_from_args(args)
        assert opts.overlap is want and opts.output == "x.json"


@pytest.mark.parametrize(
    "argv", [["bench", "--overlap", "on"], ["bench", "--out", "x.json"], ["bench", "--output-json", "x.json"]]
)
def test_the_old_spellings_are_gone(argv, capsys):  # (fuzz/zoo --out still abbreviates --out-dir)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_one_output_spelling():
    parser = build_parser()
    assert parser.parse_args(["bench", "--serve", "http://x", "--output", "f.json"]).output == "f.json"
    assert parser.parse_args(["fuzz", "--seconds", "1", "--out-dir", "d"]).out_dir == "d"
    assert parser.parse_args(["zoo", "--out-dir", "d"]).out_dir == "d"
    for command in ("minimize", "show"):
        assert parser.parse_args([command, "t.jsonl", "-o", "f"]).output == "f"


def test_bench_output_needs_a_benchmark_that_writes_it(capsys):
    assert main(["bench", "cache", "-o", "x.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvledger bench: --output needs --serve or --workload") and err.count("\n") == 1


@pytest.mark.parametrize("argv,level", [([], "info"), (["-q"], "warning"), (["--log-level", "debug"], "debug")])
def test_log_level_before_or_after_the_command(argv, level):
    from kvledger.cli.parser import log_level

    parser = build_parser()
    assert log_level(parser.parse_args([*argv, "replay", "t.jsonl"])) == level
    assert log_level(parser.parse_args(["replay", "t.jsonl", *argv])) == level


def test_minimize_progress_is_logged_and_the_result_printed(tmp_path, capsys, caplog, kvledger_log_level):
    trace, out = str(TRACES / "allocate-floor-pages.jsonl"), tmp_path / "min.jsonl"
    with caplog.at_level(logging.INFO):
        assert main(["minimize", trace, "-o", str(out), "--bug", "allocate-floor-pages", "--budget", "30"]) == 0
    progress = [r for r in caplog.records if r.name == "kvledger.checker.minimize" and r.levelno == logging.INFO]
    assert any(r.getMessage().startswith("fingerprint ") for r in progress)
    stdout = capsys.readouterr().out
    assert f": {out}" in stdout and "replay it: kvledger replay" in stdout
    assert not any(r.getMessage() in stdout for r in progress)  # progress is not on stdout

    caplog.clear()
    assert main(["minimize", trace, "-o", str(out), "--bug", "allocate-floor-pages", "-q"]) == 0
    assert not [r for r in caplog.records if r.name.startswith("kvledger") and r.levelno < logging.WARNING]
    assert "replay it" in capsys.readouterr().out  # -q hides progress, never results
