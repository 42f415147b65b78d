#!/usr/bin/env bash
# Install Azurite (the Azure Blob emulator) into <repo>/.tools/azurite, not globally.
#
# Idempotent: does nothing when the pinned version is already installed there.
# dcp_volumes.testing.servers looks for <repo>/.tools/azurite/node_modules/.bin/azurite-blob
# (override with DCP_VOLUMES_AZURITE_BIN).
#
# Usage: scripts/install_azurite.sh [VERSION]   (default 3.37.0; needs node >= 18 and npm)
set -euo pipefail

VERSION="${1:-3.37.0}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="${REPO_ROOT}/.tools/azurite"
BIN="${PREFIX}/node_modules/.bin/azurite-blob"
PKG_JSON="${PREFIX}/node_modules/azurite/package.json"

command -v npm >/dev/null 2>&1 || { echo "install_azurite: npm not found on PATH" >&2; exit 1; }

if [[ -x "${BIN}" && -f "${PKG_JSON}" ]]; then
    installed="$(node -p "require(process.argv[1]).version" "${PKG_JSON}" 2>/dev/null || true)"
    if [[ "${installed}" == "${VERSION}" ]]; then
        echo "install_azurite: azurite ${VERSION} already installed at ${PREFIX}"
        exit 0
    fi
    echo "install_azurite: found azurite ${installed:-unknown}, installing ${VERSION}"
fi

mkdir -p "${PREFIX}"
npm install --prefix "${PREFIX}" --no-audit --no-fund --loglevel=error "azurite@${VERSION}"
test -x "${BIN}" || { echo "install_azurite: ${BIN} missing after install" >&2; exit 1; }
echo "install_azurite: installed azurite ${VERSION} at ${PREFIX}"
