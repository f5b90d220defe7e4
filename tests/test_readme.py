"""The README's demo tables are what ``make readme-figures`` writes (docs/make_readme_figures.py),
not figures typed by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("make_readme_figures",
                                                  ROOT / "docs" / "make_readme_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readmes_demo_tables_are_in_the_format_the_script_writes():
    script = _script()
    assert script.problems((ROOT / "README.md").read_text()) == [], \
        "README.md's demo tables are not make readme-figures' output: run it"


def test_the_script_renders_a_demos_summaries_into_that_format(tmp_path):
    from safl.cli import main

    script = _script()
    assert main(["demo", "--bus", "local", "--rounds", "3", "--out", str(tmp_path)]) == 0
    local = script._summary(tmp_path)
    block = script.render([local, local], local, "abc1234", "2026-12-04")
    assert script.problems(block) == []
    assert "+- 0.000" in block.splitlines()[8]  # two identical runs: no spread
    broken = block.replace("| fedavg ", "| fedavg2", 1)
    assert any("fedavg" in p for p in script.problems(broken))
