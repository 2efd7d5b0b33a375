"""REFERENCE.md's "Router drops" table names every ``kvhint_router_drops_total{what}`` the
router's code can count (drop_reasons), and no other, and says of each whether it loses
something exactly as ``KvhintDrops`` (deploy/prometheus/alerts.yml) alerts on it.

Before, the values were listed nowhere an operator reads: the deploy tests classified
them, and REFERENCE.md's metrics row said "the reasons named throughout this section".
A drop added, renamed or reclassified without its row fails here."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from drop_reasons import emitted_drop_reasons
from promql_lint import parse, selected, selectors

REPO = Path(__file__).resolve().parents[3]
REFERENCE = REPO / "REFERENCE.md"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
_TICKED = re.compile(r"`([^`]*)`")


def _drops_table() -> dict[str, tuple[str, str]]:
    """The "Router drops" table: what -> (loses, what was dropped)."""
    text = REFERENCE.read_text()
    lines = text[text.index("\n## Router drops\n"):].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows: dict[str, tuple[str, str]] = {}
    for line in lines[first + 2:]:  # past the header and its |---| line
        if not line.startswith("|"):
            break
        what, loses, dropped = [cell.strip() for cell in line.strip().strip("|").split("|")]
        (name,) = _TICKED.findall(what)
        assert name not in rows, f"{name}: two rows"
        rows[name] = (loses, dropped)
    return rows


def _kvhint_drops_fires(what: str) -> bool:
    rules = yaml.safe_load(ALERTS.read_text())
    (rule,) = [rule for group in rules["groups"] for rule in group["rules"]
               if rule.get("alert") == "KvhintDrops"]
    (drops,) = [s for s in selectors(parse(rule["expr"]))
                if s.name == "kvhint_router_drops_total"]
    return selected(drops, {"what": what})


def test_every_drop_is_in_the_reference_with_whether_kvhint_drops_fires() -> None:
    rows = _drops_table()
    emitted = emitted_drop_reasons()
    assert set(rows) == emitted, (f"no row: {sorted(emitted - set(rows))}; a row for no "
                                  f"drop: {sorted(set(rows) - emitted)}")
    problems = [f"{what}: loses {loses!r}, not yes or no" for what, (loses, _) in rows.items()
                if loses not in ("yes", "no")]
    problems += [f"{what}: says nothing of what was dropped"
                 for what, (_, dropped) in rows.items() if len(dropped) < 10]
    problems += [f"{what}: the table says loses={loses}, KvhintDrops "
                 f"{'fires' if _kvhint_drops_fires(what) else 'does not fire'}"
                 for what, (loses, _) in rows.items()
                 if (loses == "yes") != _kvhint_drops_fires(what)]
    assert not problems, "REFERENCE.md's router drops table:\n" + "\n".join(problems)


def test_the_metrics_row_points_to_the_drops_table() -> None:
    text = REFERENCE.read_text()
    (row,) = [line for line in text.splitlines()
              if line.startswith("| `kvhint_router_drops_total` |")]
    assert '"Router drops"' in row
