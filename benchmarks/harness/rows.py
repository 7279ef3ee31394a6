"""One result row: what was measured, with which parameters, against what.

A row is plain data, serialised as-is into the result JSON and rendered by
harness/report.py. `status` is "ok", or "not available: <reason>" when a component the
row needs is missing: a row is never filled with a guessed figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loongforge.benchmarks.harness.measure import Stat


@dataclass(slots=True)
class Row:
    id: str  # e.g. "P1/w2"
    title: str
    unit: str  # unit of baseline/ours
    params: dict = field(default_factory=dict)
    baseline_label: str = "baseline"
    ours_label: str = "LoongForge"
    baseline: Stat | None = None
    ours: Stat | None = None
    ratio: Stat | None = None  # ours / baseline unless `ratio_note` says otherwise
    ratio_note: str = "LoongForge / baseline"
    goal: str = ""
    goal_met: bool | None = None
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # further measured values (Stat dicts or numbers)
    status: str = "ok"

    @classmethod
    def unavailable(cls, id: str, title: str, reason: str, **kw) -> "Row":
        return cls(id=id, title=title, unit=kw.pop("unit", ""), status=f"not available: {reason}", **kw)

    def to_dict(self) -> dict:
        def stat(s):
            return s.to_dict() if isinstance(s, Stat) else s

        return {
            "id": self.id, "title": self.title, "unit": self.unit, "params": self.params,
            "baseline_label": self.baseline_label, "ours_label": self.ours_label,
            "baseline": stat(self.baseline), "ours": stat(self.ours), "ratio": stat(self.ratio),
            "ratio_note": self.ratio_note, "goal": self.goal, "goal_met": self.goal_met, "notes": self.notes,
            "extra": {k: stat(v) for k, v in self.extra.items()}, "status": self.status,
        }


def component_row(kind: str, n: int, raw: dict) -> dict:
    """A row returned by benchmarks/loader/preprocess.py or cache.py `run(quick)`, kept
    verbatim under `raw` so nothing their authors measured is re-interpreted."""
    name = raw.get("id") or raw.get("name") or raw.get("row") or f"{kind}-{n}"
    return {"id": f"C-{kind}/{name}", "title": str(raw.get("title") or raw.get("name") or name),
            "status": str(raw.get("status", "ok")), "raw": raw}
