#!/usr/bin/env bash
# Run the whole test suite (unit + conformance against local servers it starts itself).
# Extra arguments go to pytest, e.g. scripts/test.sh -k seaweedfs
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${REPO_ROOT}"
bash scripts/setup.sh --azurite
export AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-us-east-1}"
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false
set +e
if [[ "${CI:-}" == true ]]; then
    # CI promises every backend: a server test that skips because its server is not
    # installed (npm missing, say) fails the run instead of passing quietly.
    log="$(mktemp)"
    trap 'rm -f "${log}"' EXIT
    .venv/bin/python -m pytest -q -n 2 --dist loadgroup -rs --durations=30 "$@" 2>&1 | tee "${log}"
    rc=${PIPESTATUS[0]}
    if grep -E "^SKIPPED .*not installed" "${log}" >&2; then
        echo "test.sh: CI=true and a backend above could not run; that is a failure" >&2
        [[ ${rc} -eq 0 ]] && rc=1
    fi
else
    .venv/bin/python -m pytest -q -n 2 --dist loadgroup "$@"
    rc=$?
fi
set -e
if [[ ${rc} -eq 5 ]]; then
    echo "test.sh: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit ${rc}
