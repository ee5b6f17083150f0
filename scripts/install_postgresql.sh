#!/bin/sh
# Makes PostgreSQL server binaries available to the test suite (tests/helpers/postgres_server.py), so `make test`
# needs no manual step on a fresh machine. Idempotent: does nothing when initdb and postgres are already found.
#   as root with apt-get (CI): Debian's `postgresql` package, without the cluster Debian would create and start;
#   otherwise: the pip-installable server `pgserver` into the given Python's environment.
# Usage: scripts/install_postgresql.sh [PYTHON]
set -eu
PYTHON="${1:-python3}"

have_server() {
    for dir in "${FEDCLINIC_PG_BINDIR:-}" "$(pg_config --bindir 2>/dev/null || true)" /usr/lib/postgresql/*/bin; do
        if [ -n "$dir" ] && [ -x "$dir/initdb" ] && [ -x "$dir/postgres" ]; then
            return 0
        fi
    done
    "$PYTHON" -c "import pgserver" 2>/dev/null
}

if have_server; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "install_postgresql: installing Debian's postgresql (server binaries for the tests)"
    mkdir -p /etc/postgresql-common
    # the tests run their own throw-away servers: no system cluster
    [ -e /etc/postgresql-common/createcluster.conf ] || echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.conf
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null
else
    echo "install_postgresql: installing pgserver (a pip-installable PostgreSQL) into $PYTHON's environment"
    "$PYTHON" -m pip install --quiet pgserver==0.1.4
fi
have_server || { echo "install_postgresql: still no PostgreSQL server binaries; set FEDCLINIC_PG_BINDIR" >&2; exit 1; }
