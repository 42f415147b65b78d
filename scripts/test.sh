#!/usr/bin/env bash
# Run the whole test suite (unit + conformance against local servers it starts itself).
# Extra arguments go to pytest, e.g. scripts/test.sh -k seaweedfs
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${REPO_ROOT}"
bash scripts/setup.sh
export AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-us-east-1}"
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false
set +e
.venv/bin/python -m pytest -q -n 2 --dist loadgroup "$@"
rc=$?
set -e
if [[ ${rc} -eq 5 ]]; then
    echo "test.sh: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit ${rc}
