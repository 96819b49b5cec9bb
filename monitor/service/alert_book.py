"""Alert lifecycle as Alertmanager's own clients keep it: every active alert is sent again at each check with an
`endsAt` beyond the next expected check, and a resolve (`endsAt` now) goes out once its condition has cleared.

The active alerts are kept whole in `<monitor.state_dir>/alerts_active.json` (written atomically, under a file lock:
the service and a manual check may meet), so a restart neither drops an alert nor sends it as new: an alert still
active keeps its `startsAt`. An alert is its labels (alertname first), as Alertmanager tells them apart.

What clears a condition: a check that reached a verdict (anything but ERROR) is the whole picture, and an active
check alert it no longer raises is resolved; an ERROR, or a check that crashed, cannot tell whether a drift or a down
replica is still there, so the active alerts stay firing beside the error. MonitorStale is resolved by the next
successful check. Events (a promotion, a rollback) are sent once, with the same `endsAt`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

from apscheduler.triggers.cron import CronTrigger
from filelock import FileLock

from monitor.service.alerts import ALERT_NAMES, STALE, Alert
from pipeline.config import DraftopsConfig
from pipeline.files import write_text_atomic

BOOK_FILE = "alerts_active.json"
CHECK_CONDITIONS = frozenset(ALERT_NAMES.values()) | {"DraftReplicaDown"}
CONDITIONS = CHECK_CONDITIONS | {STALE}
MIN_HOLD = timedelta(minutes=10)  # an active alert outlives the next expected check by at least this


def book_path(cfg: DraftopsConfig) -> Path:
    return Path(cfg.monitor.state_dir).resolve() / BOOK_FILE


def next_check(cfg: DraftopsConfig, now: datetime) -> datetime:
    """When the schedule runs the next check after `now`."""
    m = cfg.monitor
    return CronTrigger.from_crontab(m.schedule, timezone=m.timezone).get_next_fire_time(None, now)


def ends_at(cfg: DraftopsConfig, now: datetime) -> datetime:
    """The `endsAt` of an active alert: one more interval past the next expected check (a late check does not let it
    lapse; a monitor that died does, and the Prometheus rules on its own metrics page for that)."""
    upcoming = next_check(cfg, now)
    return upcoming + max(upcoming - now, MIN_HOLD)


def _key(alert: Alert) -> str:
    return json.dumps(sorted(alert.all_labels().items()))


def _to_dict(alert: Alert) -> dict:
    return {"name": alert.name, "severity": alert.severity, "model": alert.model, "summary": alert.summary,
            "description": alert.description, "labels": alert.labels, "starts_at": alert.starts_at.isoformat()}


def _from_dict(data: dict) -> Alert:
    return Alert(data["name"], data["severity"], data["model"], data["summary"], data["description"],
                 dict(data["labels"]), datetime.fromisoformat(data["starts_at"]))


def _load(path: Path) -> dict[str, dict]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def active(cfg: DraftopsConfig) -> list[Alert]:
    """The alerts the book holds active now."""
    return [_from_dict(a) for a in _load(book_path(cfg)).values()]


def lifecycle(cfg: DraftopsConfig, raised: Sequence[Alert], clears: frozenset[str] = frozenset(),
              now: datetime | None = None) -> list[Alert]:
    """What to send now: the conditions among `raised` and every other active alert, with `endsAt` past the next
    check (an ongoing one keeps its `startsAt`); a resolve for each active alert named in `clears` that `raised`
    does not hold; the events among `raised`. The book is updated whole."""
    now = datetime.now(timezone.utc) if now is None else now
    until = ends_at(cfg, now)
    path = book_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock", timeout=60):
        book = _load(path)
        raised_keys = {_key(a): a for a in raised if a.name in CONDITIONS}
        out, kept = [], {}
        for key, data in book.items():
            alert = _from_dict(data)
            if key in raised_keys or alert.name not in clears:
                kept[key] = data
            else:
                out.append(replace(alert, ends_at=now, resolved=True))
        for key, alert in raised_keys.items():
            started = kept[key]["starts_at"] if key in kept else alert.starts_at.isoformat()
            kept[key] = {**_to_dict(alert), "starts_at": started}
        out += [replace(_from_dict(data), ends_at=until) for data in kept.values()]
        out += [replace(a, ends_at=until) for a in raised if a.name not in CONDITIONS]
        write_text_atomic(path, json.dumps(kept, indent=1))
    return out
