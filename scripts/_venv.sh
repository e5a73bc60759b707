# Sourced by scripts/*: make sure .venv exists with the project (and the given extras) installed.
# Usage: ensure_venv [EXTRAS]
# The install is an editable one: the code is read from the checkout, so only pyproject.toml (the
# dependencies, the entry points) or the extras asked for can make it stale. What was installed is
# stamped with their digest; a run that finds its stamp skips pip (3 s of a short run).
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
    local stamp=".venv/.acp-proxy-installed-${extras:-none}"
    local wanted
    wanted="$(cat pyproject.toml .venv/pyvenv.cfg | .venv/bin/python -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
        return 0
    fi
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e "$spec"
    echo "$wanted" > "$stamp"
}
