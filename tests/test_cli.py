"""Flags: launch.py takes every frontend flag `python -m frontend` takes, with the same
default, since both read them from one definition (frontend.cli)."""

from __future__ import annotations

import argparse

import launch
from frontend import __main__ as frontend_main

ENGINE_LINK_FLAGS = {"--requests-addr", "--outputs-addr", "--model-dir", "--engine-info",
                     "--engine-info-fd",
                     "--engine-pid", "-h", "--help"}  # set by launch.py for each start


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings}


def test_launch_takes_each_frontend_flag_with_the_same_default() -> None:
    frontend_flags = options(frontend_main.build_parser())
    launch_flags = options(launch.build_parser())
    shared = set(frontend_flags) - ENGINE_LINK_FLAGS
    assert {"--shutdown-timeout", "--max-body-bytes", "--api-key", "--tool-call-parser"} <= shared
    for flag in shared:
        assert flag in launch_flags, flag
        assert launch_flags[flag].default == frontend_flags[flag].default, flag
