"""The dashboard's ASGI (Starlette) application: read-only, GET only, every request guarded.

Routes (all need the token and a Host naming this server, :mod:`fedclinic.dashboard.request_guard`)::

    GET /                      the page (HTML; its script and style sheet are the two files below)
    GET /static/dashboard.js   the page's script: polls the two JSON routes and places their fragments
    GET /static/dashboard.css
    GET /api/tasks             {"identity", "aggregator", "tasks": [summary, ...], "html": task list}
    GET /api/tasks/{task_id}   {"task": fedclinic.dashboard.task_view data, "events": [...], "events_note",
                                "html": {section id: fragment}}

Anything else is a JSON 404 or 405: there is no route that changes anything (no submit, cancel or approve).
The task routes ask the aggregator with the user's certificate (``Control.ListTasks`` / ``GetTask``), so the
page shows what ``fedclinic task list/status`` would; an error of the control API is a 502 carrying its text.
Every answer has ``Cache-Control: no-store``, ``Referrer-Policy: no-referrer`` (the token is in the page's URL),
a Content-Security-Policy allowing only this server's own script, style and fetches, and forbids framing.
"""

from __future__ import annotations

import html
import re
from importlib import resources
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fedclinic.dashboard import page_fragments
from fedclinic.dashboard.request_guard import RequestGuard
from fedclinic.dashboard.task_events import TaskEvents
from fedclinic.dashboard.task_view import task_summary, task_view
from fedclinic.errors import FedclinicError

TASK_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
}
STATIC = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}


def _static(name: str) -> str:
    return resources.files("fedclinic.dashboard").joinpath("static", name).read_text(encoding="utf-8")


class DashboardApp:
    """The application (:attr:`asgi`) over ``client`` (a :class:`fedclinic.client.Client`), behind ``guard``.

    ``identity``: whom the certificate names (shown in the header); ``poll_s``: how often the page asks again."""

    def __init__(self, client: Any, guard: RequestGuard, *, identity: str = "", poll_s: float = 2.0,
                 events: TaskEvents | None = None) -> None:
        self.client = client
        self.guard = guard
        self.identity = identity
        self.poll_s = poll_s
        self.events = events if events is not None else TaskEvents(client.watch)
        self._files = {name: _static(name) for name in (*STATIC, "dashboard.html")}
        app = Starlette(routes=[Route("/", self._page, methods=["GET"]),
                                Route("/static/{name}", self._file, methods=["GET"]),
                                Route("/api/tasks", self._tasks, methods=["GET"]),
                                Route("/api/tasks/{task_id}", self._task, methods=["GET"])],
                        exception_handlers={HTTPException: self._http_exception})
        self.asgi = _Guarded(app, guard)

    def _page(self, request: Request) -> Response:
        token = html.escape(request.query_params.get("token", ""))
        body = (self._files["dashboard.html"].replace("{{token}}", token)
                .replace("{{identity}}", html.escape(self.identity))
                .replace("{{aggregator}}", html.escape(self.client.address))
                .replace("{{poll_ms}}", str(int(self.poll_s * 1000))))
        return Response(body, media_type="text/html; charset=utf-8")

    def _file(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            return _error(404, f"no such file {name}")
        return Response(self._files[name], media_type=STATIC[name])

    def _tasks(self, request: Request) -> Response:
        return self._answer(lambda: self._tasks_doc(request.query_params.get("selected", "")))

    def _tasks_doc(self, selected: str) -> dict[str, Any]:
        tasks = sorted((task_summary(st) for st in self.client.list(include_finished=True)),
                       key=lambda t: t["updated_unix_ms"], reverse=True)
        return {"identity": self.identity, "aggregator": self.client.address, "tasks": tasks,
                "html": page_fragments.task_list(tasks, selected)}

    def _task(self, request: Request) -> Response:
        task_id = request.path_params["task_id"]
        if not TASK_ID.match(task_id):
            return _error(400, "a task id is letters, digits, '.', '_' and '-' (t-...)")
        return self._answer(lambda: self._task_doc(task_id))

    def _task_doc(self, task_id: str) -> dict[str, Any]:
        view = task_view(self.client.status(task_id))
        events, note = self.events.events(task_id)
        return {"task": view, "events": events, "events_note": note,
                "html": page_fragments.task_sections(view, events, note)}

    def _answer(self, make: Callable[[], dict[str, Any]]) -> Response:
        """Starlette runs these sync handlers in its thread pool: the gRPC calls block a worker, not the loop."""
        try:
            return JSONResponse(make())
        except FedclinicError as exc:  # the control API's answer, explained (not found, not yours, unreachable)
            return _error(502, str(exc))

    async def _http_exception(self, request: Request, exc: Any) -> Response:
        if exc.status_code == 405:
            return _error(405, f"{request.method} is not allowed: the dashboard is read-only (GET)")
        return _error(exc.status_code, f"no such page {request.url.path}")


def _error(status: int, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=status)


class _Guarded:
    """ASGI wrapper: refuses a request failing ``guard`` before any route sees it; adds the security headers."""

    def __init__(self, app: Any, guard: RequestGuard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        refusal = self.guard.refusal(request.headers, request.query_params)

        async def send_secured(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                message["headers"] = [*message.get("headers", []),
                                      *((k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()
                                        if k.lower().encode() not in names)]
            await send(message)

        if refusal is not None:
            return await _error(*refusal)(scope, receive, send_secured)
        await self.app(scope, receive, send_secured)
