"""The one check every configured SQL query passes before it reaches a database: a single read-only SELECT.

The query is the site admin's (``[datasets.NAME] query`` in agent.toml); a task only names the dataset and can
never pass SQL. The check scans the query's tokens outside string literals, quoted identifiers and comments:

* exactly one statement (a trailing ``;`` is allowed, any other ``;`` is refused);
* it begins with ``SELECT`` or ``WITH`` (a common table expression ending in a SELECT);
* no word that writes, changes the schema or the session anywhere in it (:data:`FORBIDDEN_WORDS`: ``INSERT``,
  ``UPDATE``, ``DELETE``, ``MERGE``, ``CREATE``, ``DROP``, ``ALTER``, ``TRUNCATE``, ``GRANT``, ``COPY``, ``CALL``,
  ``DO``, ``SET``, ``LOCK``, ``ATTACH``, ``PRAGMA``, ``INTO`` as in ``SELECT ... INTO new_table``, transaction
  control...; a column of such a name is written in double quotes), and no ``FOR UPDATE`` / ``FOR SHARE`` row
  locks.

This is the first of two guards: the query then runs in a read-only transaction (PostgreSQL:
``default_transaction_read_only`` and ``BEGIN READ ONLY``; SQLite: the file opened with ``mode=ro``), which
refuses any write the scan could not see (e.g. a function that writes).
"""

from __future__ import annotations

import re

from fedclinic.errors import ConfigError

#: words a read-only SELECT never needs; matched case-insensitively as whole words outside literals
FORBIDDEN_WORDS = frozenset("""
insert update delete merge upsert create drop alter truncate grant revoke copy call do execute exec set reset
lock vacuum attach detach pragma reindex refresh listen notify unlisten prepare deallocate discard into begin
commit rollback savepoint
""".split())

_TOKEN = re.compile(r"""
    (?P<comment>--[^\n]*|/\*.*?\*/)
  | (?P<string>'(?:[^']|'')*'|\$(?P<tag>[A-Za-z_]*)\$.*?\$(?P=tag)\$)
  | (?P<quoted>"(?:[^"]|"")*"|`[^`]*`|\[[^\]]*\])
  | (?P<word>[A-Za-z_][A-Za-z0-9_$]*)
  | (?P<semi>;)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)


def check_select(query: object, where: str) -> str:
    """``query`` without its trailing ``;`` and surrounding blanks, if it is one read-only SELECT; else a
    ConfigError naming ``where`` (e.g. "agent.toml: [datasets.notes] query") and what to change."""
    if not isinstance(query, str) or not query.strip():
        raise ConfigError(f"{where} must be a SELECT statement (a non-empty string)")
    text = query.strip()
    words: list[str] = []
    semis: list[int] = []
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup if m.lastgroup != "tag" else "string"
        if kind == "word":
            words.append(m.group().lower())
        elif kind == "semi":
            semis.append(m.start())
        elif kind == "other" and m.group() in "'\"`$" and m.group().strip():
            raise ConfigError(f"{where}: unterminated quote or literal at character {m.start() + 1}; check the "
                              "query's quotes")
    if semis and (len(semis) > 1 or text[semis[0] + 1:].strip()):
        raise ConfigError(f"{where}: give exactly one SELECT statement (found a ';' inside the query); a dataset "
                          "reads the result of one query")
    if not words or words[0] not in ("select", "with"):
        first = words[0].upper() if words else "nothing"
        raise ConfigError(f"{where}: the query must be a SELECT (or WITH ... SELECT), not {first}; a data source "
                          "only reads")
    _no_row_locks(words, where)
    bad = sorted({w for w in words if w in FORBIDDEN_WORDS})
    if bad:
        raise ConfigError(f"{where}: the query uses {', '.join(w.upper() for w in bad)}, which a read-only SELECT "
                          "does not need (writes, schema or session changes are refused); keep it to one plain "
                          "SELECT (a column of that name goes in double quotes)")
    return text[:semis[0]].strip() if semis else text


def _no_row_locks(words: list[str], where: str) -> None:
    for a, b in zip(words, words[1:]):
        if a == "for" and b in ("update", "share", "no", "key"):
            raise ConfigError(f"{where}: the query takes row locks (FOR {b.upper()} ...); a data source only reads, "
                              "remove the locking clause")


def identifier(value: object, where: str) -> str:
    """``value`` if it is a plain SQL identifier (letters, digits, ``_``; not starting with a digit), for the
    schema name of an OMOP mapping; else ConfigError."""
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", value):
        raise ConfigError(f"{where} must be a plain identifier (letters, digits and _, e.g. \"cdm\"), got {value!r}")
    return value


__all__ = ["FORBIDDEN_WORDS", "check_select", "identifier"]
