# Sourced by scripts/*: create .venv if missing and (re)install the project when pyproject.toml
# changed since the last install. $1 is the extras to install: "server,mcp" (scripts/serve: what
# the README's commands run) or "dev" (every extra and the test tools; an install of it covers
# any other). Each slow step is announced on stderr before it starts, so a first run that
# takes a minute is not a silent one (tests/acceptance/test_serve_script.py).
ensure_venv() {
    local extras="$1" stamp=".venv/.installed-$1" dev=".venv/.installed-dev"
    if [ ! -x .venv/bin/python ]; then
        echo "setting up .venv (first run only, about a minute): creating it ..." >&2
        python3 -m venv .venv
        .venv/bin/python -m pip install -q --upgrade pip
    fi
    if [ "$extras" != dev ] && [ -f "$dev" ] && [ ! pyproject.toml -nt "$dev" ]; then
        return 0
    fi
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        echo "installing cv-workspace[$extras] into .venv (pip install -e '.[$extras]') ..." >&2
        .venv/bin/python -m pip install -q -e ".[$extras]"
        touch "$stamp"
        echo ".venv is ready" >&2
    fi
}
