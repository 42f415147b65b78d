#!/usr/bin/env bash
# The main job: start a local SeaweedFS S3 server, save a model + optimizer with 2 ranks
# through VolumeWriter, load it onto 1 rank through VolumeReader, check, print the figures.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${REPO_ROOT}"
# .venv only: the demo's server is SeaweedFS from PyPI, so no Azurite, no npm.
bash scripts/setup.sh
export AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-us-east-1}"
exec .venv/bin/python examples/demo.py "$@"
