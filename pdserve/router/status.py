"""`pdserve status URL`: the router's GET /cluster as a table an operator can read at a glance."""
from __future__ import annotations

import json
import urllib.request
from typing import Any

STATUS_TIMEOUT_S = 10.0
COLUMNS = (("instance", "name"), ("role", "role"), ("state", "state"), ("sent", "sent"), ("in flight", "in_flight"),
           ("running", "running"), ("waiting", "waiting"), ("prefill tok", "prefill_tokens_waiting"),
           ("KV used", "kv_usage"), ("held", "blocks_held_for_transfer"), ("prefill tok/s", "prefill_tokens_per_s"),
           ("cached blocks", "cached_blocks"))


def fetch_cluster(url: str, api_key: str | None = None, timeout: float = STATUS_TIMEOUT_S) -> dict[str, Any]:
    """GET url/cluster; OSError when it cannot be reached or refuses, ValueError on a body that is not JSON."""
    request = urllib.request.Request(url.rstrip("/") + "/cluster")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.loads(resp.read())


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.0%}" if 0.0 <= value <= 1.0 else f"{value:,.0f}"
    return str(value)


def format_cluster(cluster: dict[str, Any]) -> str:
    instances = cluster.get("instances", [])
    rows = [[_cell(_field(inst, key)) + _unmeasured(inst, key) for _, key in COLUMNS] for inst in instances]
    widths = [max([len(title)] + [len(row[i]) for row in rows]) for i, (title, _) in enumerate(COLUMNS)]
    lines = [f"policy: {cluster.get('policy')}   mode: {cluster.get('mode')}   "
             f"requests in flight: {cluster.get('num_in_flight', 0)}",
             "  ".join(title.ljust(w) for (title, _), w in zip(COLUMNS, widths))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    for inst in instances:
        if inst.get("state") != "healthy" and inst.get("detail"):
            lines.append(f"{inst['name']}: {inst['detail']}")
    if any(_unmeasured(inst, key) for inst in instances for _, key in COLUMNS):
        lines.append("* the router's default: not measured on this instance yet")
    decisions = cluster.get("decisions") or {}
    if decisions:
        lines.append("decisions: " + ", ".join(f"{reason} {count}" for reason, count in sorted(decisions.items())))
    return "\n".join(lines)


def _unmeasured(instance: dict[str, Any], key: str) -> str:
    """"*" after a learned rate the router still takes at its default (a D that never prefilled, say)."""
    measured = (instance.get("rates") or {}).get("measured")
    return "*" if isinstance(measured, dict) and measured.get(key) is False else ""


def _field(instance: dict[str, Any], key: str) -> Any:
    if key in instance:
        return instance[key]
    for group in ("load", "rates"):
        if isinstance(instance.get(group), dict) and key in instance[group]:
            return instance[group][key]
    return None
