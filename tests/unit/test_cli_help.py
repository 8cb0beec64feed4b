"""Every option of every command says what it does, and its default where it has one."""

import argparse

from eagle_states.cli import build_parser


def test_every_option_has_help_and_names_its_default():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = []
    for name, command in {"": parser, **commands}.items():
        for action in command._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            label = f"{name} {'/'.join(action.option_strings) or action.dest}"
            if not action.help:
                missing.append(f"{label}: no help")
            elif action.default not in (None, False) and "default" not in action.help:
                missing.append(f"{label}: default {action.default!r} not named")
    assert not missing, missing
