#!/usr/bin/env bash
# The project's one test command (README; .ci/run calls it too).  Self-contained on a fresh machine:
# installs the package with its test extras, makes sure PostgreSQL answers, then runs lint, types,
# the whole test suite (every backend) and the benchmarks at their smallest size.
#
#   bash scripts/test.sh            # everything
#   bash scripts/test.sh -k claims  # extra arguments go to pytest
#
# pytest runs in LIGHTNING_SQL_TEST_WORKERS processes (pytest-xdist; default 3 on the CI machine's 2
# cores: most tests wait on a database, a child process or a socket, and the main suite took 10.2
# minutes with three workers against 12.3 with two on a 2-vCPU machine; the whole CI run 14 minutes);
# 0 runs it in this process (-x, --pdb).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
export LITELLM_LOCAL_MODEL_COST_MAP=True  # agentlightning imports offline
export LIGHTNING_SQL_TEST_POSTGRES_URL=${LIGHTNING_SQL_TEST_POSTGRES_URL:-postgresql://postgres@127.0.0.1:5432/postgres}

echo "== install"
"$PYTHON" -m pip install --quiet --disable-pip-version-check -e '.[dev,analysis,agentlightning,server,browser,proxy]'

echo "== postgresql"
if command -v pg_isready >/dev/null 2>&1; then
  if ! pg_isready -q -h 127.0.0.1 -p 5432; then
    if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
      for version in $(ls /etc/postgresql); do
        pg_ctlcluster --skip-systemctl-redirect "$version" main start || [ $? -eq 2 ]
      done
    fi
    for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
  fi
  pg_isready -h 127.0.0.1 -p 5432 || echo "PostgreSQL is not reachable: its tests will skip (or fail under LIGHTNING_SQL_REQUIRE_POSTGRES=1)"
else
  echo "pg_isready not found: PostgreSQL tests will skip (or fail under LIGHTNING_SQL_REQUIRE_POSTGRES=1)"
fi

echo "== system packages"
# tests/faults starts Debian's pgbouncer in front of a throwaway cluster (PgBouncer in transaction
# mode); tests/dashboard drives Debian's chromium through Playwright (no browser download).
missing=()
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ] || missing+=(chromium)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "not installed: ${missing[*]} (apt-get install -y ${missing[*]}): their tests skip (CI requires them)"
  fi
fi

echo "== lint and types"
"$PYTHON" -m ruff check lightning_sql tests benchmarks examples
"$PYTHON" -m mypy lightning_sql

run_pytest() {
  set +e
  "$PYTHON" -m pytest -p no:cacheprovider -q -rs --durations=15 -n "${LIGHTNING_SQL_TEST_WORKERS:-3}" "$@"
  local status=$?
  set -e
  if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure" >&2
    exit 1
  fi
  [ "$status" -eq 0 ] || exit "$status"
}

echo "== tests"
if [ "$#" -gt 0 ]; then
  run_pytest "$@"
else
  run_pytest --ignore=tests/contrib
  # Agent-Lightning keeps process-wide tracer state (OpenTelemetry provider, active tracer) and forks
  # its runners: its end-to-end tests get an interpreter of their own.
  echo "== tests (Agent-Lightning bridge)"
  run_pytest tests/contrib
fi

if [ "$#" -eq 0 ]; then
  echo "== benchmarks (smallest size, no thresholds: keeps the benchmark code honest)"
  "$PYTHON" -m benchmarks --backend all --size small --repeat 1
fi
