#!/usr/bin/env bash
# The notebook widgets in a real browser (make browser-check).
#
# Runs notebooks/06-continuous-batching.ipynb inside JupyterLab in headless
# Chromium, moves the step player's slider, and checks that its pictures render
# and change (tools/browser_check.mjs says exactly what is checked).
# Screenshots land in build/screenshots/.
#
# Needs: the .venv (make setup), node + npm, and Chromium. What is missing and can
# be installed is installed: Debian's chromium through apt (as root, or with sudo),
# playwright-core through npm into tools/node_modules.
#
# JupyterLab runs on 127.0.0.1 with a random token and is always stopped on exit.
# It gets its own settings with autosave off, so running the notebook in the
# browser never writes outputs into the repository's copy.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
NOTEBOOK="${BROWSER_CHECK_NOTEBOOK:-notebooks/06-continuous-batching.ipynb}"  # another for debugging the check
RUN_TIMEOUT="${BROWSER_CHECK_TIMEOUT:-420}"  # seconds for the notebook to run in the browser
LOG="build/browser-check-jupyter.log"

say() { echo "[browser-check] $*"; }
die() { echo "[browser-check] FAIL: $*" >&2; exit 1; }

[ -x "$PY" ] || die "no Python at $PY; run 'make setup' first"
[ -x "$VENV/bin/jupyter" ] || die "no JupyterLab in $VENV; run 'make setup' (it installs the notebooks extra)"

# ---- Chromium and playwright-core ------------------------------------------------------
. tools/browser_setup.sh

# ---- JupyterLab --------------------------------------------------------------------------
stop_lab() {
    status=$?
    if [ -n "$LAB_PID" ] && kill -0 "$LAB_PID" 2>/dev/null; then
        # SIGTERM lets the server shut its kernels down; its whole process group
        # (it was started with setsid) goes if anything is left after 15 s.
        kill -TERM "$LAB_PID" 2>/dev/null || true
        for _ in $(seq 1 30); do kill -0 "$LAB_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL -- "-$LAB_PID" 2>/dev/null || true
        say "JupyterLab stopped"
    fi
    # Belt and braces: the repository's notebook must leave exactly as it came.
    if [ -f "$SCRATCH/notebook-before.ipynb" ] && ! cmp -s "$NOTEBOOK" "$SCRATCH/notebook-before.ipynb"; then
        cp "$SCRATCH/notebook-before.ipynb" "$NOTEBOOK"
        echo "[browser-check] FAIL: JupyterLab saved $NOTEBOOK during the check; restored it" >&2
        status=1
    fi
    rm -rf "$SCRATCH"
    exit "$status"
}
SCRATCH="$(mktemp -d)"  # Lab's settings and workspace, a copy of the notebook; removed on exit
LAB_PID=""
trap stop_lab EXIT
trap 'exit 130' INT TERM

mkdir -p build/screenshots
rm -f build/screenshots/06-*.png
cp "$NOTEBOOK" "$SCRATCH/notebook-before.ipynb"
# Lab's own settings for this run only: never save the notebook, keep every cell
# in the page (so the check sees them all), and fetch no news from the internet.
settings() { mkdir -p "$SCRATCH/settings/$1"; echo "$3" >"$SCRATCH/settings/$1/$2.jupyterlab-settings"; }
settings @jupyterlab/docmanager-extension plugin '{ "autosave": false }'
settings @jupyterlab/notebook-extension tracker '{ "windowingMode": "none" }'
settings @jupyterlab/apputils-extension notification '{ "fetchNews": "false" }'
PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
TOKEN="$("$PY" -c 'import secrets; print(secrets.token_hex(24))')"

# The kernel and the browser share this machine: leave the browser a core, or on a
# small machine torch's threads and Chromium slow each other down many times over.
if [ -z "${OMP_NUM_THREADS:-}" ]; then
    CORES="$(nproc)"
    export OMP_NUM_THREADS="$(( CORES > 2 ? CORES - 1 : 1 ))"
fi
ROOT_FLAG=()
[ "$(id -u)" -ne 0 ] || ROOT_FLAG=(--allow-root)  # containers and CI often run as root
say "starting JupyterLab on 127.0.0.1:$PORT (log: $LOG)"
JUPYTERLAB_SETTINGS_DIR="$SCRATCH/settings" JUPYTERLAB_WORKSPACES_DIR="$SCRATCH/workspaces" \
    setsid "$VENV/bin/jupyter" lab --no-browser --ip=127.0.0.1 --port="$PORT" \
    --IdentityProvider.token="$TOKEN" --ServerApp.root_dir="$ROOT" --ServerApp.port_retries=0 \
    --ServerApp.terminals_enabled=False "${ROOT_FLAG[@]}" >"$LOG" 2>&1 &
LAB_PID=$!

for attempt in $(seq 1 120); do
    if "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
        "http://127.0.0.1:$PORT/api/status?token=$TOKEN" 2>/dev/null; then
        break
    fi
    kill -0 "$LAB_PID" 2>/dev/null || die "JupyterLab exited while starting; see $LOG"
    [ "$attempt" -lt 120 ] || die "JupyterLab did not answer on port $PORT within 120 s; see $LOG"
    sleep 1
done
say "JupyterLab is up"

# The browser part gets the run timeout plus time to open Lab and move the slider.
timeout "$((RUN_TIMEOUT + 300))" node tools/browser_check.mjs --url "http://127.0.0.1:$PORT" --token "$TOKEN" \
    --notebook "$NOTEBOOK" --out build/screenshots --timeout "$RUN_TIMEOUT" \
    || die "the browser check failed (exit $?); screenshots in build/screenshots/, Lab's log in $LOG"
say "screenshots:"
ls -1 build/screenshots/06-*.png
