"""A command whose extra is not installed (`make run` installs none) names the extra and exits 2;
a missing module that is no extra's, or one whose package is installed, is a real error and raises."""

from __future__ import annotations

import argparse

import pytest

from kvledger import cli
from kvledger.cli import extras


def test_a_missing_extra_is_named(monkeypatch):
    monkeypatch.setitem(extras.EXTRA_OF, "kvledger_absent_pkg", "tools")
    message = extras.missing_extra(ModuleNotFoundError("x", name="kvledger_absent_pkg.sub"), "fuzz")
    assert message is not None and "'tools' extra" in message and "kvledger_absent_pkg" in message
    assert "kvledger fuzz" in message and ".[tools]" in message


def test_a_missing_module_of_no_extra_or_an_installed_one_is_a_real_error():
    assert extras.missing_extra(ModuleNotFoundError("x", name="kvledger_absent_pkg"), "fuzz") is None
    # hypothesis is installed: a ModuleNotFoundError naming it is a broken install, not a missing extra
    assert extras.missing_extra(ModuleNotFoundError("x", name="hypothesis"), "fuzz") is None


def test_main_answers_2_with_the_message(monkeypatch, capsys):
    from kvledger.cli import subjects

    monkeypatch.setitem(extras.EXTRA_OF, "kvledger_absent_pkg", "serve")

    def needs_the_extra(args: argparse.Namespace) -> int:
        import kvledger_absent_pkg  # noqa: F401

        return 0

    monkeypatch.setattr(subjects, "_subjects", needs_the_extra)  # the command the parser registers
    assert cli.main(["subjects"]) == 2
    assert "kvledger subjects needs the 'serve' extra (kvledger_absent_pkg is not installed)" in capsys.readouterr().err

    def broken(args: argparse.Namespace) -> int:
        import kvledger_other_absent_pkg  # noqa: F401

        return 0

    monkeypatch.setattr(subjects, "_subjects", broken)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["subjects"])
