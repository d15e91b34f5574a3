# Sourced by scripts/*: create .venv if missing and (re)install the project when pyproject.toml
# changed since the last install. $1 is the extra to install (dev or server).
ensure_venv() {
    local extra="$1" stamp=".venv/.installed-$1"
    if [ ! -x .venv/bin/python ]; then
        python3 -m venv .venv
        .venv/bin/python -m pip install -q --upgrade pip
    fi
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        .venv/bin/python -m pip install -q -e ".[$extra]"
        touch "$stamp"
    fi
}
