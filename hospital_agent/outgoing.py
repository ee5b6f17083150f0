"""What the agent says to the aggregator about why it declines or holds work: the one place such text is made.

Anything that leaves the site (a ``Decline`` or ``Hold`` reason, which the aggregator records in the task's events
and shows to the task owner) names the rule that failed and at most a row number, never a path of this site, a
value from its data or a label set read from a row. The full detail (file, row and content) stays in the site's
own log and in ``hospital-agent`` output, where the site's IT reads it.

- :class:`~fedclinic.errors.DatasetError`: its public summary (``rule`` and ``row``, set where the reader raised
  it), or a generic sentence when the raiser gave none; ``str(exc)`` is never sent.
- any other exception or text: its text with every absolute path replaced by ``<site path>``, cut to
  :data:`MAX_REASON_CHARS`.
"""

from __future__ import annotations

import re

from fedclinic.errors import DatasetError

#: the longest reason sent (the aggregator keeps reasons in its events; a reason is a sentence, not a report)
MAX_REASON_CHARS = 500

SITE_LOG_HINT = "the site's IT has the details in the agent log"

# an absolute POSIX path (``/a/b``, ``~/a``) or a Windows one (``C:\\a``, ``\\\\server\\share``), not preceded by
# a word character (so "and/or", "1/2" and "tokenizer.json" stay)
_ABS_PATH = re.compile(r"""(?<![\w.~/\\])(?:~?/|[A-Za-z]:[\\/]|\\\\)[^\s'"`,;()\[\]{}<>]+""")


def scrub_paths(text: str) -> str:
    """``text`` with every absolute path replaced by ``<site path>``."""
    return _ABS_PATH.sub("<site path>", text)


def outgoing_reason(what: BaseException | str, *, dataset: str | None = None) -> str:
    """The sentence the aggregator (and through it the task owner) may see for ``what``, a site-side error or a
    reason text; ``dataset`` is the task's dataset name (the task spec names it, so it is no news)."""
    if isinstance(what, DatasetError):
        name = f" {dataset!r}" if dataset else ""
        detail = what.public or "its data cannot be read as the task needs it"
        text = f"the dataset{name} does not meet the task's data contract: {detail}; {SITE_LOG_HINT}"
    elif isinstance(what, BaseException):
        text = scrub_paths(str(what)) or f"{type(what).__name__} at the site; {SITE_LOG_HINT}"
    else:
        text = scrub_paths(what)
    if len(text) > MAX_REASON_CHARS:
        text = text[:MAX_REASON_CHARS - 1] + "…"
    return text


def declined_for_good(exc: BaseException) -> bool:
    """A data problem (DatasetError) declines the task for good at this site: the same data fails the same way.
    Not when the error says it may pass (``transient``: a data source's database that cannot be reached now);
    then only the round is declined, and the next one is tried again."""
    return isinstance(exc, DatasetError) and not getattr(exc, "transient", False)
