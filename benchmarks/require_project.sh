# Sourced by the GPU check scripts: stop early, naming the fix, when $PY cannot import the project.
# A GPU image's own python3 (used when .venv is absent) has torch but usually not the project's
# other dependencies (pydantic-settings, gymnasium, ...).
#   require_project WHO MODULE    # exit 2 with the missing module's error and the fix
require_project() {
  local missing
  if ! missing=$("$PY" -c "import $2" 2>&1); then
    echo "$1: $PY cannot import $2: $(printf '%s\n' "$missing" | tail -n 1)" >&2
    echo "$1: fix: 'make setup' (creates .venv), or install the project into that interpreter" \
         "('$PY -m pip install -e .'), or point PYTHON at one that has it" >&2
    exit 2
  fi
}
