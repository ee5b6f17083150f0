"""``fedclinic dashboard``: a local, read-only web page over the control API, with the user's own certificate.

The page shows what ``fedclinic task status`` and ``watch`` show, kept up to date: the user's tasks, their rounds,
the sites the open round waits for (held, declined, not answering), plots per round, the cross-site evaluation
matrix and statistics tables once a task has them, and the task's event trail.

- :mod:`fedclinic.dashboard.task_view`: a TaskStatus as the page's data (JSON-ready, no HTML);
- :mod:`fedclinic.dashboard.svg_plot`: line plots as inline SVG, rendered on the server;
- :mod:`fedclinic.dashboard.page_fragments`: the page's sections as escaped HTML fragments;
- :mod:`fedclinic.dashboard.task_events`: the task events the page lists, followed in the background;
- :mod:`fedclinic.dashboard.request_guard`: the per-launch token and the Host check every request passes;
- :mod:`fedclinic.dashboard.app`: the Starlette application (GET only);
- :mod:`fedclinic.dashboard.server`: binding rules, the uvicorn server and the ``fedclinic dashboard`` command.
"""
