#!/usr/bin/env bash
# The server's live dashboard in a real browser (make dashboard-check).
#
# Starts `python -m minicb serve` on SmolLM2 with 4 slots, opens http://127.0.0.1:PORT/
# in headless Chromium, fires more streaming chat requests than there are slots, and
# checks that the page shows the slots filling, a request finishing and its slot
# refilled, and every block free at the end (tools/dashboard_check.mjs says exactly
# what is checked). Screenshots land in build/screenshots/09-dashboard-*.png.
#
# Needs: the .venv (make setup), node + npm, and Chromium; what is missing and can be
# installed is installed, as tools/browser_check.sh does. The server listens on
# 127.0.0.1 only and is always stopped on exit.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
LOG="build/dashboard-check-server.log"
START_TIMEOUT="${DASHBOARD_CHECK_START_TIMEOUT:-300}"  # seconds for the model to load and the server to answer

say() { echo "[dashboard-check] $*"; }
die() { echo "[dashboard-check] FAIL: $*" >&2; exit 1; }

[ -x "$PY" ] || die "no Python at $PY; run 'make setup' first"

# ---- Chromium and playwright-core, as for the notebook check ---------------------------------
. tools/browser_setup.sh

# ---- the server --------------------------------------------------------------------------------
stop_server() {
    status=$?
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true  # a graceful shutdown: drain, abort, exit
        for _ in $(seq 1 40); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
        say "server stopped"
    fi
    exit "$status"
}
SERVER_PID=""
trap stop_server EXIT
trap 'exit 130' INT TERM

mkdir -p build/screenshots
rm -f build/screenshots/09-dashboard-*.png
PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# The server and the browser share this machine: leave the browser a core.
if [ -z "${OMP_NUM_THREADS:-}" ]; then
    CORES="$(nproc)"
    export OMP_NUM_THREADS="$(( CORES > 2 ? CORES - 1 : 1 ))"
fi
say "starting python -m minicb serve on 127.0.0.1:$PORT (log: $LOG)"
setsid "$PY" -m minicb serve --host 127.0.0.1 --port "$PORT" --max-num-seqs 4 --shutdown-timeout 5 \
    --log-level warning >"$LOG" 2>&1 &
SERVER_PID=$!

for attempt in $(seq 1 "$START_TIMEOUT"); do
    if "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
        "http://127.0.0.1:$PORT/health" 2>/dev/null; then
        break
    fi
    kill -0 "$SERVER_PID" 2>/dev/null || die "the server exited while starting; see $LOG"
    [ "$attempt" -lt "$START_TIMEOUT" ] || die "the server did not answer within $START_TIMEOUT s; see $LOG"
    sleep 1
done
say "server is up"

# minicb.viz's request colours, for the page's to be compared with (as CSS rgb() strings).
COLORS="$("$PY" -c 'import json; from minicb.viz import request_color as c
print(json.dumps({f"{i},{int(p)}": "rgb({},{},{})".format(*(round(x * 255) for x in c(i, p))) for i in range(8) for p in (0, 1)}))')"
timeout 600 node tools/dashboard_check.mjs --url "http://127.0.0.1:$PORT" --out build/screenshots --colors "$COLORS" \
    || die "the dashboard check failed (exit $?); screenshots in build/screenshots/, the server's log in $LOG"
say "screenshots:"
ls -1 build/screenshots/09-dashboard-*.png
