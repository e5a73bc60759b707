# Sourced by scripts/*: make sure .venv exists with the project (and the given extras) installed.
# Usage: ensure_venv [EXTRAS]
ensure_venv() {
    local extras="${1:-}"
    local python="${PYTHON:-python3}"
    if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "acp-proxy needs Python 3.11 or newer (tried '$python'; set PYTHON=/path/to/python3.11)" >&2
        exit 2
    fi
    if [ ! -x .venv/bin/python ]; then
        "$python" -m venv .venv
    fi
    local spec="."
    [ -n "$extras" ] && spec=".[$extras]"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e "$spec"
}
