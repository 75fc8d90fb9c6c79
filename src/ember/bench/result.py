"""A benchmark's result: groups of requests with their summaries, saved as JSON.

A result directory holds ``requests.json`` (one raw record per request, each
naming its group) and ``summary.json`` (the run's configuration, every
group's parameters and ``Summary``, and workload-specific ``extras``); the
report adds ``summary.md`` and the PNG plots. ``load_result`` reads a
directory back, which is what ``ember bench compare`` works from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ember.bench.loadgen import RunResult
from ember.bench.metrics import SLO, Summary, summarize
from ember.bench.record import RequestRecord, load_records, save_records

REQUESTS_FILE = "requests.json"
SUMMARY_FILE = "summary.json"
MARKDOWN_FILE = "summary.md"


@dataclass
class Group:
    """Requests run under one setting (e.g. concurrency 4 and max_tokens 32) and their summary."""

    label: str
    params: dict[str, Any]
    records: list[RequestRecord]
    start_s: float
    end_s: float
    summary: Summary

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def make_group(label: str, params: dict[str, Any], run: RunResult, slo: SLO) -> Group:
    """A ``Group`` of ``run``'s records, labelled and summarized over the run's wall time."""
    for record in run.records:
        record.group = label
    return Group(label, params, run.records, run.start_s, run.end_s, summarize(run.records, run.duration_s, slo))


@dataclass
class Section:
    """A workload-specific part of the Markdown report (a verdict, a per-turn table...)."""

    title: str
    markdown: str


@dataclass
class BenchResult:
    """Everything one ``ember bench <workload>`` run measured.

    ``plots`` names the plots the report draws (see ``report.PLOTS``);
    ``extras`` holds workload-specific numbers for machines, ``sections`` the
    same for people.
    """

    workload: str
    config: dict[str, Any]
    groups: list[Group]
    slo: SLO = SLO()
    plots: list[str] = field(default_factory=lambda: ["latency_cdf"])
    sections: list[Section] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
    started_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    @property
    def records(self) -> list[RequestRecord]:
        return [record for group in self.groups for record in group.records]

    def summary_dict(self) -> dict[str, Any]:
        """The content of ``summary.json``."""
        return {
            "workload": self.workload,
            "started_at": self.started_at,
            "config": self.config,
            "slo": self.slo.to_dict(),
            "plots": self.plots,
            "groups": [
                {"label": g.label, "params": g.params, "start_s": g.start_s, "end_s": g.end_s, "summary": g.summary.to_dict()}
                for g in self.groups
            ],
            "sections": [{"title": s.title, "markdown": s.markdown} for s in self.sections],
            "extras": self.extras,
        }


def save_result(result: BenchResult, out_dir: Path) -> None:
    """Write ``requests.json`` and ``summary.json`` into ``out_dir`` (created if needed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_records(result.records, out_dir / REQUESTS_FILE)
    (out_dir / SUMMARY_FILE).write_text(json.dumps(result.summary_dict(), indent=2, default=str) + "\n")


def load_result(path: Path) -> BenchResult:
    """Read a result back from its directory (or from its ``summary.json``)."""
    directory = path.parent if path.is_file() else path
    summary_path = directory / SUMMARY_FILE
    if not summary_path.exists():
        raise FileNotFoundError(f"{summary_path} not found: pass a directory written by 'ember bench'")
    data = json.loads(summary_path.read_text())
    requests_path = directory / REQUESTS_FILE
    records = load_records(requests_path) if requests_path.exists() else []
    groups = [
        Group(
            label=g["label"],
            params=g["params"],
            records=[r for r in records if r.group == g["label"]],
            start_s=g["start_s"],
            end_s=g["end_s"],
            summary=Summary.from_dict(g["summary"]),
        )
        for g in data["groups"]
    ]
    return BenchResult(
        workload=data["workload"],
        config=data["config"],
        groups=groups,
        slo=SLO(**data.get("slo", {})),
        plots=data.get("plots", ["latency_cdf"]),
        sections=[Section(**s) for s in data.get("sections", [])],
        extras=data.get("extras", {}),
        started_at=data.get("started_at", ""),
    )
