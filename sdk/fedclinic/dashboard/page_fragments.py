"""The dashboard's sections as HTML fragments, from :mod:`fedclinic.dashboard.task_view`'s data.

Every string that came from the aggregator (task and site names, reasons, event messages) is escaped here; the
page's script only places these fragments (``innerHTML``) and runs no code from them (the page's
Content-Security-Policy allows the one shipped script file only).
"""

from __future__ import annotations

import html
import time
from typing import Any, Mapping, Sequence

from fedclinic.dashboard.svg_plot import fmt, line_plot
from fedclinic.dashboard.task_view import metric_order

#: the order plots are shown in
PLOT_ORDER = ("global", "sites", "bytes", "epsilon")
#: metric columns of the rounds table at most
ROUND_COLUMNS = 5
#: the newest events listed openly (the earlier ones are folded)
EVENTS_SHOWN = 12


def _e(value: Any) -> str:
    return html.escape(str(value))


def _num(value: Any) -> str:
    return "–" if value is None else _e(value) if isinstance(value, str) else _e(f"{value:.4g}")


def _when(unix_ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_ms / 1000)) if unix_ms else ""


def task_list(tasks: Sequence[Mapping[str, Any]], selected: str) -> str:
    """The list of the user's tasks, newest first; each a link to ``#TASK_ID``."""
    if not tasks:
        return '<p class="empty">no tasks visible to this certificate</p>'
    items = []
    for t in tasks:
        cls = "task selected" if t["task_id"] == selected else "task"
        items.append(f'<li class="{cls}" data-task="{_e(t["task_id"])}"><a href="#{_e(t["task_id"])}">'
                     f'<span class="name">{_e(t["name"])}</span> <span class="state state-{_e(t["state"])}">'
                     f'{_e(t["state"])}</span><br><span class="meta">{_e(t["task_id"])} · round '
                     f'{t["rounds_closed"]}/{t["rounds_planned"]}</span></a></li>')
    return '<ul class="tasks">' + "".join(items) + "</ul>"


def summary(view: Mapping[str, Any]) -> str:
    parts = [f'<h2>{_e(view["name"])} <span class="state state-{_e(view["state"])}">{_e(view["state"])}</span></h2>',
             f'<p class="meta">{_e(view["task_id"])} · {_e(view["kind"])} · owner {_e(view["owner"])} · '
             f'{view["rounds_closed"]} of {view["rounds_planned"]} round(s) closed'
             + (" · secure aggregation" if view["secure_aggregation"] else "")
             + ("" if view["signed"] else ' · <strong>unsigned</strong>') + "</p>"]
    if view["error"]:
        parts.append(f'<p class="error">{_e(view["error"])}</p>')
    return "".join(parts)


def sites(view: Mapping[str, Any]) -> str:
    """The last round's sites: reported, declined, held (with the site's reason) or waiting."""
    if not view["sites"]:
        return ""
    what = "waits for" if view["sites_round_open"] else "heard from"
    rows = "".join(f'<tr class="site site-{_e(s["state"]).replace(" ", "-")}" data-site="{_e(s["site"])}">'
                   f'<td>{_e(s["site"])}</td><td class="site-state">{_e(s["state"])}</td>'
                   f'<td>{_e(s["detail"])}</td></tr>' for s in view["sites"])
    return (f'<h3>Sites: round {view["sites_round"]} {"(open)" if view["sites_round_open"] else "(closed)"}</h3>'
            f'<p class="meta">whom the round {what}</p>'
            f'<table class="sites"><tr><th>site</th><th>state</th><th>detail</th></tr>{rows}</table>')


def rounds(view: Mapping[str, Any]) -> str:
    """One row per round: state, sites, bytes, ε and the headline metrics."""
    if not view["rounds"]:
        return '<p class="empty">no round opened yet</p>'
    keys = metric_order({k for r in view["rounds"] for k in r["metrics"]})[:ROUND_COLUMNS]
    private = any(r["epsilon"] is not None for r in view["rounds"])
    head = ("<th>ε</th>" if private else "") + "".join(f"<th>{_e(k)}</th>" for k in keys)
    body = []
    for r in view["rounds"]:
        cells = (f'<td class="num">{_num(r["epsilon"])}</td>' if private else "") + "".join(
            f'<td class="num">{_num(r["metrics"].get(k))}</td>' for k in keys)
        body.append(f'<tr class="round round-{_e(r["state"])}" data-round="{r["round"]}"><td>{r["round"]}</td>'
                    f'<td>{_e(r["state"])}</td><td class="num">{r["reports"]}/{r["sites_target"]}</td>'
                    f'<td class="num">{_e(fmt(r["uplink_bytes"], "B"))}</td>'
                    f'<td class="num">{_e(fmt(r["downlink_bytes"], "B"))}</td>{cells}</tr>')
    note = ('<p class="meta">eval_* figures are the sites\' evaluation of the model each round started from; '
            "every figure: <code>fedclinic task status ID --json</code>.</p>"
            if any(r["eval_sites"] for r in view["rounds"]) else "")
    return ('<h3>Rounds</h3><table class="rounds"><tr><th>round</th><th>state</th><th>sites</th><th>up</th>'
            f'<th>down</th>{head}</tr>{"".join(body)}</table>{note}')


def plots(view: Mapping[str, Any]) -> str:
    """Each plot of the task as a figure with its title (server-side SVG)."""
    out = []
    for name in PLOT_ORDER:
        plot = view["plots"].get(name)
        if plot is not None:
            out.append(f'<figure class="plot-box"><figcaption>{_e(plot["title"])}</figcaption>'
                       f'{line_plot(name, plot["title"], plot["series"], plot["unit"])}</figure>')
    return '<h3>Per round</h3><div class="plots">' + "".join(out) + "</div>" if out else ""


def results(view: Mapping[str, Any]) -> str:
    """The cross-site evaluation matrix (headline value per site and model, pooled row), each cell's values,
    and the statistics table of a statistics task."""
    res = view["results"]
    if res is None:
        return ""
    state = "open" if res["open"] else "closed"
    parts = [f'<h3>Results: {_e(res["work"] or "evaluation")} ({state})</h3>']
    m = res["matrix"]
    if m["models"] and res["work"] != "statistics":
        head = "".join(f"<th>{_e(model)}</th>" for model in m["models"])
        rows = "".join(f'<tr><td>{_e(site)}</td>' + "".join(f'<td class="num">{_num(cells.get(model))}</td>'
                                                           for model in m["models"]) + "</tr>"
                       for site, cells in m["rows"].items())
        pooled = ('<tr class="pooled"><td>pooled</td>' + "".join(f'<td class="num">{_num(m["pooled"].get(model))}'
                                                                 "</td>" for model in m["models"]) + "</tr>")
        parts.append(f'<p class="meta">{_e(m["metric"])} per site (rows) and model (columns)</p>'
                     f'<table class="matrix"><tr><th>site</th>{head}</tr>{rows}{pooled}</table>')
        keys = sorted({k for c in res["cells"] for k in c["values"]})[:8]
        detail = "".join(f'<tr><td>{_e(c["site"])}</td><td>{_e(c["model"])}</td><td class="num">{c["rows"]}</td>'
                         + ('<td colspan="99">suppressed (fewer rows than the site\'s min_cell_rows)</td>'
                            if c["suppressed"] else "".join(f'<td class="num">{_num(c["values"].get(k))}</td>'
                                                            for k in keys)) + "</tr>" for c in res["cells"])
        parts.append('<details><summary>every cell</summary><table class="cells"><tr><th>site</th><th>model</th>'
                     "<th>rows</th>" + "".join(f"<th>{_e(k)}</th>" for k in keys) + f"</tr>{detail}</table></details>")
    stats = res.get("statistics")
    if stats:
        head = "".join(f"<th>{_e(s)}</th>" for s in stats["sites"])
        rows = "".join(f"<tr><td>{_e(k)}</td>" + "".join(f'<td class="num">{_num(stats["values"][s].get(k))}</td>'
                                                         for s in stats["sites"])
                       + f'<td class="num">{_num(stats["pooled"].get(k))}</td></tr>' for k in stats["keys"])
        parts.append(f'<table class="statistics"><tr><th>statistic</th>{head}<th>pooled</th></tr>{rows}</table>')
    parts += [f'<p class="declined">declined: {_e(d)}</p>' for d in res["declined"]]
    if res["waiting"]:
        parts.append(f'<p class="meta">waiting for: {_e(", ".join(res["waiting"]))}</p>')
    return "".join(parts)


def events(items: Sequence[Mapping[str, Any]], note: str = "") -> str:
    """The task's events, newest first (time, kind, message): the last :data:`EVENTS_SHOWN`, the earlier ones
    folded under a ``<details>``."""
    if not items and not note:
        return ""

    def row(ev: Mapping[str, Any]) -> str:
        return (f'<tr class="event event-{_e(ev["kind"])}"><td>{_e(_when(ev["unix_ms"]))}</td>'
                f'<td class="kind">{_e(ev["kind"])}</td><td>{_e(ev["message"])}</td></tr>')

    head = "<tr><th>time</th><th>event</th><th>message</th></tr>"
    newest = list(reversed(items))
    parts = [f'<h3>Events</h3>{f"<p class=meta>{_e(note)}</p>" if note else ""}',
             f'<table class="events">{head}{"".join(map(row, newest[:EVENTS_SHOWN]))}</table>']
    if len(newest) > EVENTS_SHOWN:
        parts.append(f'<details><summary>{len(newest) - EVENTS_SHOWN} earlier event(s)</summary>'
                     f'<table class="events">{head}{"".join(map(row, newest[EVENTS_SHOWN:]))}</table></details>')
    return "".join(parts)


def task_sections(view: Mapping[str, Any], event_items: Sequence[Mapping[str, Any]], event_note: str = ""
                  ) -> dict[str, str]:
    """Every section of a task's page: id of the page element -> its HTML."""
    return {"summary": summary(view), "sites": sites(view), "rounds": rounds(view), "plots": plots(view),
            "results": results(view), "events": events(event_items, event_note)}
