# Sourced by browser_check.sh and dashboard_check.sh, from the repository root, once
# they have defined say and die: Debian's Chromium and playwright-core, installed
# the first time and found after that.

command -v node >/dev/null && command -v npm >/dev/null || die "node and npm are needed (e.g. apt-get install -y nodejs npm)"

if [ ! -x /usr/bin/chromium ]; then
    say "installing Debian's chromium with apt-get"
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || die "/usr/bin/chromium is missing and installing it needs root or sudo"
        SUDO="sudo"
    fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
[ -x /usr/bin/chromium ] || die "/usr/bin/chromium is still missing after apt-get install chromium"

if [ ! -f tools/node_modules/playwright-core/package.json ]; then
    say "installing playwright-core into tools/node_modules (npm)"
    (cd tools && npm install --no-package-lock --no-audit --no-fund --loglevel=error)
fi
