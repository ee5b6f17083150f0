"""Leader election through PostgreSQL (aggregator_service.leader_election) on the suite's real server: one leader at a
time, the standby wins once the leader's session ends, the leader is told when its lock session dies, and a store
transaction of a replica that does not hold the lock (or no longer does) is refused before it writes."""

from __future__ import annotations

import threading

import pytest

from aggregator_service.leader_election import LeaderElection, NotLeader
from aggregator_service.store import DatabaseSettings, PostgresStore
from fedclinic.federation.local_federation import wait_until

from tests.helpers.ha import end_leader_lock_session


@pytest.fixture()
def database(postgres_server):
    name = postgres_server.create_database()
    yield name
    postgres_server.drop_database(name)


def _election(server, database: str, poll_s: float = 0.1):
    settings = DatabaseSettings(url=server.dsn(database), password_file=server.password_file(), pool_size=2)
    lost: list[str] = []
    elected = threading.Event()
    e = LeaderElection(settings, poll_s, on_elected=elected.set, on_lost=lost.append)
    return e, elected, lost


def test_one_leader_at_a_time_and_the_standby_wins_when_the_leader_goes(postgres_server, database):
    first, first_elected, _ = _election(postgres_server, database)
    second, second_elected, _ = _election(postgres_server, database)
    first.start()
    wait_until(first_elected.is_set, 30, "the first replica to be elected")
    # the server drops the lock session of a leader whose host vanished within seconds, not the OS's 2 hours
    assert first._conn.execute("SHOW tcp_keepalives_idle").fetchone()[0] in ("5", "5s")
    second.start()
    try:
        assert not second_elected.wait(1.0)  # ten polls: the lock stays with the first
        first.stop()  # its session ends: the lock is free
        wait_until(second_elected.is_set, 10, "the standby to be elected")
    finally:
        first.stop()
        second.stop()


def test_a_leader_whose_lock_session_dies_is_told_and_its_writes_are_refused(postgres_server, database, tmp_path):
    settings = DatabaseSettings(url=postgres_server.dsn(database), password_file=postgres_server.password_file(),
                                pool_size=2)
    store = PostgresStore(settings, tmp_path)
    election, elected, lost = _election(postgres_server, database, poll_s=0.1)
    store.fence = election.fence
    try:
        with pytest.raises(NotLeader, match="standby"):  # not elected yet: no write at all
            with store.transaction():
                pass
        election.start()
        wait_until(elected.is_set, 30, "the replica to be elected")
        with store.transaction():  # the leader writes
            pass
        slow, slow_elected, slow_lost = _election(postgres_server, database, poll_s=30)
        election.stop()
        slow.start()
        wait_until(slow_elected.is_set, 10, "the second replica to be elected")
        store.fence = slow.fence
        assert end_leader_lock_session(postgres_server, database) == [(True,)]
        # its next poll is 30 s away: the write is refused by the fence inside the transaction, not by the poll
        with pytest.raises(NotLeader, match="lost the leader lock"):
            with store.transaction():
                pass
        assert slow_lost == []
        slow.stop()
        # a leader polling often hears of it
        third, third_elected, third_lost = _election(postgres_server, database, poll_s=0.1)
        third.start()
        wait_until(third_elected.is_set, 10, "the third replica to be elected")
        end_leader_lock_session(postgres_server, database)
        wait_until(lambda: third_lost, 10, "the leader to notice its lock session died")
        assert "lock connection failed" in third_lost[0]
        third.stop()
    finally:
        election.stop()
        store.close()
