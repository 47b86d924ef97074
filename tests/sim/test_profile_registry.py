"""The simulator's profiles are registered in one place (`mlxproxy.sim.profiles.PROFILES`), and
what lists them is made from it or checked against it: `sim --profile`'s choices and help, the
wire styles a profile may name, and docs/SIMULATOR.md's profile table."""

from __future__ import annotations

import re
from pathlib import Path

import click

from mlxproxy.sim.cli import SIM_HELP, sim
from mlxproxy.sim.profiles import PROFILES, WIRE_STYLES, get_profile
from mlxproxy.sim.styles import STYLES
from support import REPO


def test_the_cli_choices_and_help_are_the_registry() -> None:
    option = next(p for p in sim.params if p.name == "profile_name")
    assert isinstance(option.type, click.Choice)
    assert list(option.type.choices) == list(PROFILES)
    assert ", ".join(PROFILES) in SIM_HELP and sim.help == SIM_HELP


def test_every_profile_names_a_registered_wire_style() -> None:
    assert WIRE_STYLES == tuple(STYLES)
    assert {p.wire for p in PROFILES.values()} <= set(STYLES)
    assert all(get_profile(name).name == name for name in PROFILES)


def test_the_docs_profile_table_lists_the_registry_in_its_order() -> None:
    text = (Path(REPO) / "docs" / "SIMULATOR.md").read_text(encoding="utf-8")
    table = text[text.index("| profile | key knobs |") :]
    table = table[: table.index("\n\n")]
    names = [re.sub(r"\s*\(default\)", "", n) for n in re.findall(r"^\| `([^`]+)`(?: \(default\))? \|", table, re.M)]
    assert names == list(PROFILES)
