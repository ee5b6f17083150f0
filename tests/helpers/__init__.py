"""Builders and drivers the unit and integration tests share (tiny models, data, tasks, replays, scrapes).

Test modules import these from here, never from each other; conftest.py files hold fixtures only."""
