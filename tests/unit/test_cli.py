from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvhint.router.cli import main
from kvhint.schemas.export import MESSAGES


def test_schemas_export_writes_json_schema_per_message(tmp_path: Path) -> None:
    assert main(["schemas", "export", str(tmp_path / "out")]) == 0
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == sorted(f"{name}.schema.json" for name in MESSAGES)
    envelope = json.loads((tmp_path / "out" / "KvHintsEnvelope.schema.json").read_text())
    required = envelope["$defs"]["KvHintsEnvelope"]["required"]
    assert set(required) == {"protocol_version", "message_id", "actions"}


def test_console_script_runs() -> None:
    bin_dir = Path(sys.executable).parent
    out = subprocess.run([str(bin_dir / "kvhint"), "--help"], capture_output=True, text=True,
                         check=True).stdout
    for command in ("up", "schemas", "router", "sim"):
        assert command in out
