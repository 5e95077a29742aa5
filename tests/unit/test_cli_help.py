"""Every `ascent ... --help` renders (argparse %-formats help strings: a stray % used to crash it)."""

from __future__ import annotations

import argparse

import pytest

from ascent.entrypoints.cli import build_parser, main


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def test_every_command_renders_its_help():
    seen = []
    for path, parser in _parsers(build_parser()):
        text = parser.format_help()
        assert text.startswith("usage: ascent"), path
        seen.append(path)
    assert {("generate",), ("chat",), ("serve",), ("quantize",), ("bench", "throughput")} <= set(seen)


def test_help_keeps_a_literal_percent(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    assert "25% of available memory" in capsys.readouterr().out


def test_version(capsys):
    from ascent import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"ascent {__version__}"
