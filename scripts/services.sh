#!/usr/bin/env bash
# Starts the services the tests talk to, when they are not running: PostgreSQL (127.0.0.1:5432, database
# `test`) and Redis (127.0.0.1:6379). Installs them from Debian's packages on a machine that lacks them.
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }
apt_install() {
  if [ "$(id -u)" = 0 ] && have apt-get; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    echo "services: please install: $*" >&2
    return 1
  fi
}

# PostgreSQL
if ! (have pg_isready && pg_isready -q -h 127.0.0.1 -p 5432); then
  have pg_ctlcluster || apt_install postgresql
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -n 1)" main start || true
  for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
pg_isready -h 127.0.0.1 -p 5432
# The tests use database `test` as user postgres with trust auth on loopback.
if ! psql -h 127.0.0.1 -U postgres -d test -c "select 1" >/dev/null 2>&1; then
  su postgres -c "createdb test" 2>/dev/null || createdb -h 127.0.0.1 -U postgres test || true
fi

# Redis
if ! (have redis-cli && redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1); then
  have redis-server || apt_install redis-server
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
  for _ in $(seq 1 30); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 1; done
fi
echo "services: postgres and redis are up"
