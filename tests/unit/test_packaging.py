"""The distribution claims only ``kvhint.*`` and lists every package it has."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for package, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    assert found == listed


def test_no_generic_top_level_names(tmp_path: Path) -> None:
    probe = (
        "import importlib.util, kvhint.schemas, kvhint.router, kvhint.engine_plugin;"
        "print([n for n in ('router', 'schemas', 'engine_plugin', 'migrations')"
        " if importlib.util.find_spec(n)])"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, check=True,
                         capture_output=True, text=True).stdout.strip()
    assert out == "[]"
