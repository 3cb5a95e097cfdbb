"""Reports a person and a program can read: aligned lines, or one JSON object."""
from __future__ import annotations

import dataclasses
import json

from .results import Mode, RunReport, Status


def to_json(report: RunReport) -> str:
    data = dataclasses.asdict(report)
    data["ok"] = report.ok
    for fix, result in zip(data["fixes"], report.fixes):
        fix["exact"] = result.exact
        fix["target"] = ", ".join(result.targets)
        fix["files"] = sorted({f for p in result.patches for f in p.files})
    return json.dumps(data, indent=2)


def _shown(report: RunReport, status: Status) -> str:
    """A status as the report prints it: in a dry run, what the fix would do."""
    return str(status.unwritten() if report.mode == Mode.CHECK else status) or "not reached"


def _exactness(exact: bool | None) -> str:
    return {True: "exact", False: "by context", None: ""}[exact]


def to_text(report: RunReport) -> str:
    lines = [f"profile {report.profile}: {report.mode} ({', '.join(report.scope)})"]
    for path in report.recovered:
        lines.append(f"  recovered an interrupted run: restored {path}")
    for tree in report.finished:
        lines.append(f"  finished an interrupted run that had written every file: kept {tree} as it wrote it")
    for t in report.targets.values():
        verdict = "matches pin" if t.matches else "DOES NOT match pin"
        lines.append(f"  {t.name:<11} {t.commit or 'unknown':<12.12} {verdict} {t.pin[:12]} ({t.ref}); "
                     f"{t.how}")
    width = max((len(f.name) for f in report.fixes), default=0)
    total = len(report.fixes)
    outside = [f.name for f in report.fixes if f.status == Status.OUT_OF_SCOPE]
    if outside:
        lines.append(f"  out of scope ({', '.join(report.scope)} only): {', '.join(outside)}")
    for index, fix in enumerate(report.fixes, start=1):
        if fix.status == Status.OUT_OF_SCOPE:
            continue
        status = _shown(report, fix.status)
        exact = _exactness(fix.exact)
        line = f"  [{index:>2}/{total}] {fix.name:<{width}}  {status}{f' ({exact})' if exact else ''}"
        if fix.reason and fix.status not in (Status.PATCHED, Status.ALREADY_APPLIED):
            line += f": {fix.reason}"
        elif fix.reason:
            line += f" — {fix.reason}"
        lines.append(line)
    counts: dict[str, int] = {}
    for fix in report.fixes:
        key = _shown(report, fix.status)
        counts[key] = counts.get(key, 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in counts.items())
    if report.ok:
        tail = "nothing written" if not report.mode.writes or not report.written \
            else f"{len(report.written)} files written"
        lines.append(f"OK: {summary}; {tail}")
        lines += [f"  stamp: {s}" for s in report.stamps]
    else:
        lines.append(f"REFUSED (exit {report.exit_code}): {report.error}")
        if summary:
            lines.append(f"  ({summary})")
    return "\n".join(lines)
