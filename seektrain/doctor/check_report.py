"""What the doctor found: rows of (status, name, detail), printed as a table or JSON.

Statuses, in order of severity: ``ok``, ``info`` (a fact, nothing to do), ``warn`` (works, but slower or
riskier than it should), ``blocker`` (a job would fail or could not be trusted: the doctor exits 1).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from seektrain.exit_codes import EXIT_FAILED, EXIT_OK

STATUSES = ("ok", "info", "warn", "blocker")


@dataclass
class Check:
    status: str
    name: str
    detail: str
    host: str = ""  # filled in when several nodes report

    def __post_init__(self) -> None:
        assert self.status in STATUSES, self.status


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)
    comm: dict | None = None  # comm.py's measurements, when --comm ran

    def extend(self, checks: list[Check]) -> None:
        self.checks.extend(checks)

    @property
    def blockers(self) -> list[Check]:
        return [c for c in self.checks if c.status == "blocker"]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == "warn"]

    @property
    def exit_code(self) -> int:
        return EXIT_FAILED if self.blockers else EXIT_OK

    def to_json(self) -> str:
        return json.dumps(
            {
                "checks": [asdict(c) for c in self.checks],
                "blockers": len(self.blockers),
                "warnings": len(self.warnings),
                "comm": self.comm,
            },
            indent=1,
        )

    def render(self) -> str:
        width = max((len(c.name) for c in self.checks), default=0)
        lines = []
        for c in self.checks:
            host = f"[{c.host}] " if c.host else ""
            label = "BLOCKER" if c.status == "blocker" else c.status
            first, *rest = c.detail.splitlines() or [""]
            lines.append(f"{label:<8} {host}{c.name:<{width}}  {first}")
            lines += [f"{'':<8} {'':<{len(host) + width}}  {line}" for line in rest]
        if self.comm:
            from seektrain.doctor.comm import render_table

            lines += ["", render_table(self.comm)]
        verdict = (
            f"{len(self.blockers)} blocker(s): a job here would fail; fix the BLOCKER lines above"
            if self.blockers
            else "no blockers"
        )
        lines += ["", f"{verdict}, {len(self.warnings)} warning(s)"]
        return "\n".join(lines)
