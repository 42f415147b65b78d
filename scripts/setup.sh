#!/usr/bin/env bash
# Create .venv and install dcp_volumes with everything its tests, demo and benchmarks use.
# Idempotent: reinstalls only when pyproject.toml changed since the last successful run.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${REPO_ROOT}"
PY="${PYTHON:-python3}"
VENV="${REPO_ROOT}/.venv"
STAMP="${VENV}/.dcpv-setup-stamp"
want="$(sha256sum pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)"

if [[ ! -x "${VENV}/bin/python" ]]; then
    "${PY}" -m venv "${VENV}"
fi
if [[ -f "${STAMP}" && "$(cat "${STAMP}")" == "${want}" ]]; then
    echo "setup: .venv up to date"
else
    # torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
    "${VENV}/bin/pip" install --quiet --disable-pip-version-check "torch==2.13.0"
    # constraints.txt pins what the suite was last run with: fast, reproducible resolution.
    "${VENV}/bin/pip" install --quiet --disable-pip-version-check -c constraints.txt \
        -e ".[all,test,bench]"
    echo "${want}" > "${STAMP}"
    echo "setup: installed dcp_volumes and its extras into .venv"
fi
# Azurite (Azure Blob emulator) from npm into .tools/, for the Azure conformance tests.
if command -v npm >/dev/null 2>&1; then
    bash "${REPO_ROOT}/scripts/install_azurite.sh" || echo "setup: azurite install failed; Azure tests will skip" >&2
else
    echo "setup: npm not found; Azure tests will skip" >&2
fi
