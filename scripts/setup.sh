#!/usr/bin/env bash
# Create .venv and install dcp_volumes with everything its tests, demo and benchmarks use.
# Idempotent: reinstalls only when pyproject.toml changed since the last successful run.
#
# Usage: scripts/setup.sh [--azurite]
#   --azurite  also install Azurite (the Azure Blob emulator, from npm) into .tools/ for the
#              Azure tests. Without node and npm they skip, but under CI=true setup fails:
#              CI promises every backend.
set -euo pipefail
with_azurite=0
for arg in "$@"; do
    case "${arg}" in
        --azurite) with_azurite=1 ;;
        *) echo "setup: unknown argument ${arg} (usage: scripts/setup.sh [--azurite])" >&2; exit 2 ;;
    esac
done
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
        -e ".[all,test,bench,integrations,docs]"
    # torchtitan without its dependencies: it pins datasets<4.8, which needs an fsspec older
    # than s3fs/gcsfs here, and its trainer-only ones (datasets, wandb, tensorboard) are not
    # on the checkpoint path the integration and its tests use; these are (installed first,
    # so pip has no missing dependency of torchtitan's to complain about).
    "${VENV}/bin/pip" install --quiet --disable-pip-version-check -c constraints.txt \
        tyro einops spmd_types torchdata
    "${VENV}/bin/pip" install --quiet --disable-pip-version-check -c constraints.txt \
        --no-deps "torchtitan==0.3.0"
    echo "${want}" > "${STAMP}"
    echo "setup: installed dcp_volumes and its extras into .venv"
fi
# Azurite (Azure Blob emulator) from npm into .tools/, for the Azure conformance tests.
azurite_missing() {
    if [[ "${CI:-}" == true ]]; then
        echo "setup: $1; CI runs the Azure tests, which need Azurite" >&2
        exit 1
    fi
    echo "setup: $1; the Azure tests will skip" >&2
}
if [[ ${with_azurite} -eq 1 ]]; then
    if ! command -v npm >/dev/null 2>&1; then
        azurite_missing "npm not found (install node >= 18 with npm: apt-get install nodejs npm)"
    elif ! bash "${REPO_ROOT}/scripts/install_azurite.sh"; then
        azurite_missing "the Azurite install failed"
    fi
fi
