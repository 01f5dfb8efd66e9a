#!/usr/bin/env bash
# `make test`'s run: the whole suite in .venv on two pytest workers (each test module stays on one
# worker, so module fixtures hold), while the second venv (the newest transformers) is set up
# beside it; then the transformers end-to-end tests again in that venv. Exit 1 if either failed.
set -uo pipefail
VENV=${VENV:-.venv}
VENV_TF_LATEST=${VENV_TF_LATEST:-.venv-tf-latest}
WORKERS=${KVTIER_TEST_WORKERS:-2}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
bash scripts/setup-venv-tf-latest.sh >"$log" 2>&1 &
tf_setup=$!
if [ "$WORKERS" -gt 1 ]; then
  dist=(-n "$WORKERS" --dist loadfile)
else
  dist=()
fi
"$VENV/bin/python" -m pytest -q "${dist[@]}" tests
rc=$?
if ! wait "$tf_setup"; then
  echo "run-tests: setting up $VENV_TF_LATEST failed:" >&2
  cat "$log" >&2
  exit 1
fi
KVTIER_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/kvtier-tf-latest "$VENV_TF_LATEST/bin/python" -m pytest -q \
  tests/e2e/test_transformers.py tests/e2e/test_transformers_restart.py || rc=1
exit $rc
