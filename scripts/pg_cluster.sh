#!/usr/bin/env bash
# A throwaway PostgreSQL cluster for tests and benches, from the distribution's PostgreSQL
# (Debian's `postgresql` package; `scripts/test.sh` installs it when missing).
#
#   scripts/pg_cluster.sh start DIR    # initdb on first use, start; prints the URL (only line on stdout):
#                                      #   postgres://postgres@127.0.0.1:PORT/lift
#   scripts/pg_cluster.sh stop DIR     # fast shutdown (no error when it is not running)
#   scripts/pg_cluster.sh kill DIR     # immediate shutdown: simulates a crash (recovery on next start)
#   scripts/pg_cluster.sh destroy DIR  # stop, then remove DIR/data, DIR/port and DIR/log
#
# Layout: DIR/data (the cluster), DIR/port (its TCP port, kept across restarts), DIR/log (server
# log), DIR/.s.PGSQL.PORT (its Unix socket). The server listens on 127.0.0.1 only, with trust
# authentication for user `postgres`: never use this for anything but throwaway data.
#
# initdb and postgres refuse to run as root: as root, they run as the `postgres` system user
# (created with `useradd -r -m postgres` if missing) and DIR is chowned to it, so DIR and every
# directory above it must be traversable by that user (/tmp/... from mktemp is fine).
# Everything but the URL goes to stderr. Exit status 2: PostgreSQL is not installed.
set -euo pipefail

usage() {
  echo "usage: $0 start|stop|kill|destroy DIR" >&2
  exit 64
}
log() { echo "pg_cluster: $*" >&2; }

[ $# -eq 2 ] || usage
cmd=$1
dir=$2
case "$cmd" in start | stop | kill | destroy) ;; *) usage ;; esac

# ---------------------------------------------------------------- the binaries
bindir=""
if command -v pg_config >/dev/null 2>&1; then
  b=$(pg_config --bindir 2>/dev/null || true)
  if [ -n "$b" ] && [ -x "$b/initdb" ] && [ -x "$b/pg_ctl" ]; then bindir=$b; fi
fi
if [ -z "$bindir" ]; then
  # The newest installed major version (sort -V: 9.6 < 15 < 16).
  for b in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V); do
    if [ -x "$b/initdb" ] && [ -x "$b/pg_ctl" ]; then bindir=$b; fi
  done
fi
if [ -z "$bindir" ]; then
  log "PostgreSQL server binaries (initdb, pg_ctl) not found: neither 'pg_config --bindir' nor"
  log "/usr/lib/postgresql/*/bin has them. Install them: apt-get install postgresql"
  exit 2
fi

# ---------------------------------------------------------------- as whom
if [ "$(id -u)" -eq 0 ]; then
  as_root=1
  if ! id -u postgres >/dev/null 2>&1; then
    log "creating the postgres system user (initdb/postgres refuse to run as root)"
    useradd -r -m postgres >&2
  fi
else
  as_root=0
fi
# Runs a PostgreSQL server program as the user that may run it.
as_pg() {
  if [ "$as_root" -eq 1 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

case "$dir" in *"'"* | *'"'* | *[[:space:]]*)
  log "DIR must not contain quotes or whitespace (pg_ctl passes options through a shell): $dir"
  exit 64 ;;
esac
if [ "$cmd" = start ]; then mkdir -p "$dir"; fi
if [ ! -d "$dir" ]; then
  # stop/kill/destroy of a cluster that was never made: nothing to do.
  log "$dir does not exist; nothing to $cmd"
  exit 0
fi
dir=$(cd "$dir" && pwd -P)
data=$dir/data
# The postgres user may not be able to read the caller's working directory (/root, say).
cd /

pg_running() {
  [ -f "$data/PG_VERSION" ] && as_pg "$bindir/pg_ctl" -D "$data" status >/dev/null 2>&1
}

stop_cluster() { # $1: fast | immediate
  if pg_running; then
    as_pg "$bindir/pg_ctl" -D "$data" -m "$1" -w stop >&2
  else
    log "not running: $data"
  fi
}

case "$cmd" in
stop)
  stop_cluster fast
  exit 0
  ;;
kill)
  stop_cluster immediate
  exit 0
  ;;
destroy)
  stop_cluster fast
  rm -rf "$data" "$dir/port" "$dir/log"
  log "removed $data"
  exit 0
  ;;
esac

# ---------------------------------------------------------------- start
if [ "$as_root" -eq 1 ]; then
  chown -R postgres "$dir"
  if ! runuser -u postgres -- test -w "$dir" -a -x "$dir"; then
    log "user postgres cannot write $dir (a directory above it is not traversable by others?);"
    log "use a directory under /tmp, e.g. \$(mktemp -d)"
    exit 1
  fi
fi

free_port() {
  if command -v python3 >/dev/null 2>&1; then
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
    return
  fi
  # Without python3: random ports until one refuses a connection.
  local p
  for _ in $(seq 1 200); do
    p=$((20000 + RANDOM % 40000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
      echo "$p"
      return
    fi
  done
  log "no free TCP port found"
  exit 1
}

if [ ! -d "$data" ]; then
  log "initdb $data ($bindir)"
  # --no-sync: as fsync=off below, nothing here has to survive a machine crash.
  as_pg "$bindir/initdb" -D "$data" --auth=trust --encoding=UTF8 --locale=C --username=postgres \
    --no-sync >&2
  free_port >"$dir/port"
elif [ ! -s "$dir/port" ]; then
  log "$data exists but $dir/port does not; picking a new port"
  free_port >"$dir/port"
fi
port=$(cat "$dir/port")
url="postgres://postgres@127.0.0.1:$port/lift"

if pg_running; then
  log "already running on port $port"
else
  # The Unix socket lives in DIR; its path is limited to ~107 bytes. A longer DIR gets no Unix
  # socket (everything here connects over TCP anyway).
  sockdir=$dir
  if [ $((${#dir} + ${#port} + 12)) -gt 100 ]; then
    log "$dir is too long for a Unix socket path; TCP only"
    sockdir=""
  fi
  # fsync=off: the cluster is throwaway; skipping the flushes makes tests and benches much faster
  # and does not change what a client sees. (A crash of the *machine* could corrupt the data;
  # `kill` only kills the processes, and the data survives that: the OS still has every write.)
  if ! as_pg "$bindir/pg_ctl" -w -D "$data" -l "$dir/log" \
    -o "-p $port -k '$sockdir' -c listen_addresses=127.0.0.1 -c fsync=off" start >&2; then
    log "the server did not start; the end of $dir/log:"
    tail -n 20 "$dir/log" >&2 || true
    exit 1
  fi
fi

# The `lift` database, created if absent (on the first start, in practice).
psql_cmd=("$bindir/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$port" -U postgres -d postgres -tA)
exists=$("${psql_cmd[@]}" -c "select 1 from pg_database where datname = 'lift'")
if [ "$exists" != 1 ]; then
  log "creating database lift"
  "${psql_cmd[@]}" -c "create database lift" >&2
fi
echo "$url"
