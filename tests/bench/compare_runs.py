"""Compare two sets of ``poise sim`` reports run by the same commands at two commits: does a change move the
numbers, and which requests' records differ.

    python -m tests.bench.compare_runs BEFORE_DIR AFTER_DIR [--out FILE.md]

Each directory holds one sub-directory per run (``poise sim --out-dir DIR/NAME ...``) with its
``report.json``; runs are matched by name. A refactor that must not change behaviour shows 0 records
differing; a change of rule shows how far each summary figure moved.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

FIGURES = ("slo_attainment", "token_attainment", "refused_share", "refused_token_share", "late_share",
           "ttft_p90_s", "tpot_p90_s", "retries")


def _report(run: Path) -> dict[str, Any] | None:
    path = run / "report.json"
    return json.loads(path.read_text()) if path.exists() else None


def _records(report: dict[str, Any]) -> dict[tuple[str, object], dict[str, Any]]:
    return {(r["rid"], r.get("attempts")): r for r in report["records"]}


def _cell(before: object, after: object) -> str:
    if isinstance(before, float) and isinstance(after, float):
        return f"{before:.3f} → {after:.3f}"
    return f"{before} → {after}"


def _without_out_dir(command: str) -> str:
    words = command.split()
    if "--out-dir" in words:
        at = words.index("--out-dir")
        del words[at:at + 2]
    return " ".join(words)


def compare(before: Path, after: Path) -> list[str]:
    """The markdown table's lines: one row per run found in both directories."""
    lines = ["| run | command | " + " | ".join(FIGURES) + " | records differing |",
             "|---|---|" + "---:|" * (len(FIGURES) + 1)]
    for run in sorted(p for p in before.iterdir() if p.is_dir()):
        a, b = _report(run), _report(after / run.name)
        if a is None or b is None:
            continue
        ra, rb = _records(a), _records(b)
        differing = sum(1 for key, rec in ra.items() if rb.get(key) != rec) + len(rb.keys() - ra.keys())
        cells = [_cell(a["summary"].get(f), b["summary"].get(f)) for f in FIGURES]
        command = _without_out_dir(a["command"])
        lines.append(f"| {run.name} | `{command}` | " + " | ".join(cells)
                     + f" | {differing} / {len(ra.keys() | rb.keys())} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--out", type=Path, help="also write the table to this markdown file")
    args = parser.parse_args()
    table = "\n".join(compare(args.before, args.after))
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
