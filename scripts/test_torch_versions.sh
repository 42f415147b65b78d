#!/usr/bin/env bash
# Run the core tests (no object-store server: local and memory backends, 2-rank gloo, the
# Checkpointer, the CLI on file://) on the oldest and the newest torch that pyproject.toml
# admits, each in a venv of its own that holds torch, the test tools and nothing else.
#
# The venvs live outside the repo and are reused: ${DCPV_TORCH_VENVS:-~/.cache/dcp_volumes/
# torch-venvs}/torch-X.Y.Z, rebuilt only when what they install changes (a stamp holds its
# hash). A cold run downloads each torch from the registry (a CUDA build, ~3.7 GB installed;
# 2.14.1 lies on this machine's disk); a warm one installs nothing.
#
# Usage: scripts/test_torch_versions.sh [PYTEST ARGS...]
#   DCPV_TORCH_VERSIONS  versions to test (default: the two ends below)
#   DCPV_TORCH_VENVS     where the venvs are kept
#   DCPV_TORCH_TIMEOUT   seconds one version's pytest run may take (default 900)
# Prints one line per version: "torch 2.8.0: N passed, N failed, N skipped". Exits non-zero if
# any version fails, errors, or collects no test.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${REPO_ROOT}"

# The ends of the supported range; pyproject.toml's torch bound must name exactly these minors
# at its ends (checked below), so the claim and the test cannot drift apart. Why 2.8 and not
# older: dcp_volumes/_compat.py, GLOO_TEARDOWN_MAY_DEADLOCK.
OLDEST=2.8.0
NEWEST=2.14.1
read -r -a VERSIONS <<< "${DCPV_TORCH_VERSIONS:-${OLDEST} ${NEWEST}}"
VENVS="${DCPV_TORCH_VENVS:-${HOME}/.cache/dcp_volumes/torch-venvs}"
PY="${PYTHON:-python3}"
TIMEOUT="${DCPV_TORCH_TIMEOUT:-900}"

# dcp_volumes' own dependencies and what the core tests use. numpy: torch's object collectives
# (broadcast_object_list, which DCP and the Checkpointer use) need it, and torch does not
# declare it. Versions come from constraints.txt, where it names them.
TEST_DEPS=(fsspec crc32c numpy pytest pytest-timeout pytest-xdist psutil "setuptools>=68" wheel)
# The test modules that exercise torch: local and memory backends, 2-rank gloo (the
# conformance suite's multi-rank and async tests), the Checkpointer, the CLI on file://.
# Found by name anywhere under tests/, so moving a module between tiers needs no change here;
# a module that is gone fails the run. The main suite runs everything else once: modules that
# never touch torch (goodput, error translation, read planning, ...) and test_distributed.py,
# whose 2-rank saves the conformance suite repeats. no_servers_plugin deselects what in these
# needs an object-store server.
CORE_TESTS=(test_local.py test_core_local.py test_untrusted_reads.py test_url_checks.py
            test_typed_failures.py test_spool_failures.py test_lifecycle_safety.py
            test_catalog.py test_checkpointer.py test_cli.py test_plan_caching.py)

check_bound() {
    "${PY}" - "${OLDEST}" "${NEWEST}" <<'EOF'
import re, sys, tomllib
oldest, newest = (tuple(int(x) for x in v.split(".")[:2]) for v in sys.argv[1:3])
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
spec = next(d for d in deps if re.match(r"torch\b", d))
lo = re.search(r">=\s*(\d+)\.(\d+)", spec)
hi = re.search(r"<\s*(\d+)\.(\d+)", spec)
if not lo or (int(lo[1]), int(lo[2])) != oldest:
    sys.exit(f"pyproject.toml says {spec!r} but the oldest torch tested is {sys.argv[1]}")
if hi and (int(hi[1]), int(hi[2])) != (newest[0], newest[1] + 1):
    sys.exit(f"pyproject.toml says {spec!r} but the newest torch tested is {sys.argv[2]}")
EOF
}

pins() {  # pip constraints for the test deps, from constraints.txt where it names them
    local dep
    for dep in "$@"; do
        grep -iE "^${dep//-/[-_]}==" constraints.txt || true
    done
}

# ensure_venv VERSION: create or update VENVS/torch-VERSION; prints nothing on a warm hit.
ensure_venv() {
    local version="$1" venv="${VENVS}/torch-$1"
    local py_version deps want
    py_version="$("${PY}" -c 'import sys; print(sys.version.split()[0])')"
    deps="$(pins "${TEST_DEPS[@]}" | sort | tr '\n' ' ')"
    want="$(printf '%s\n' "python ${py_version}" "torch ${version}" "deps ${TEST_DEPS[*]}" \
        "pins ${deps}" "repo ${REPO_ROOT}" "$(sha256sum pyproject.toml)" \
        | sha256sum | cut -d' ' -f1)"
    if [[ -f "${venv}/.dcpv-stamp" && "$(cat "${venv}/.dcpv-stamp")" == "${want}" ]]; then
        return 0
    fi
    echo "torch ${version}: setting up ${venv}"
    if ! "${venv}/bin/python" -c 'import sys' >/dev/null 2>&1; then
        rm -rf "${venv}"
        mkdir -p "${VENVS}"
        "${PY}" -m venv "${venv}"
    fi
    rm -f "${venv}/.dcpv-stamp"
    local pip=("${venv}/bin/python" -m pip --disable-pip-version-check --quiet)
    # torch alone first, at the exact version, with whatever its own dependencies resolve to.
    "${pip[@]}" install --no-cache-dir "torch==${version}"
    # Then the test tools, constrained to what is now installed, so that nothing can move
    # torch or a library it pinned (torch 2.6 wanted sympy 1.13.1 where constraints.txt has 1.14).
    local cons="${venv}/.dcpv-constraints.txt"
    "${venv}/bin/python" -m pip freeze --exclude-editable > "${cons}"
    pins "${TEST_DEPS[@]}" | grep -viF -f <(cut -d= -f1 "${cons}" | sed 's/$/==/') >> "${cons}" || true
    "${pip[@]}" install -c "${cons}" "${TEST_DEPS[@]}"
    "${pip[@]}" install --no-deps --no-build-isolation -e .
    # The venv must hold the torch asked for, and dcp-volumes' bound must admit it.
    "${venv}/bin/python" - "${version}" <<'EOF'
import sys
from importlib.metadata import version
got = version("torch").split("+")[0]
if got != sys.argv[1]:
    sys.exit(f"expected torch {sys.argv[1]}, the venv has {got}")
EOF
    "${pip[@]}" check
    echo "${want}" > "${venv}/.dcpv-stamp"
}

# summary VERSION LOG RC: one line from pytest's last line, e.g. "3 failed, 40 passed, ..."
summary() {
    local line count word passed=0 failed=0 skipped=0 errors=0
    line="$(grep -E '^(=+ )?[0-9]+ [a-z]+.* in [0-9.]+s' "$2" | tail -1 || true)"
    for word in passed failed skipped error errors; do
        count="$(grep -oE "[0-9]+ ${word}\b" <<< "${line}" | cut -d' ' -f1 || true)"
        case "${word}" in
            passed) passed="${count:-0}" ;; failed) failed="${count:-0}" ;;
            skipped) skipped="${count:-0}" ;; *) errors=$((errors + ${count:-0})) ;;
        esac
    done
    local text="torch $1: ${passed} passed, ${failed} failed, ${skipped} skipped"
    (( errors > 0 )) && text+=", ${errors} errors"
    (( $3 != 0 )) && text+=" (pytest exit $3)"
    echo "${text}"
}

core_paths() {
    local name found
    for name in "${CORE_TESTS[@]}"; do
        found="$(find tests -name "${name}" -type f)"
        if [[ -z "${found}" || "${found}" == *$'\n'* ]]; then
            echo "test_torch_versions: want one tests/**/${name}, found: ${found:-none};" \
                "update CORE_TESTS in $0" >&2
            return 1
        fi
        echo "${found}"
    done
}

check_bound
mapfile -t TEST_PATHS < <(core_paths)
(( ${#TEST_PATHS[@]} == ${#CORE_TESTS[@]} )) || exit 1
mkdir -p "${VENVS}"
logs="$(mktemp -d)"
trap 'rm -rf "${logs}"' EXIT
lines=()
status=0
for version in "${VERSIONS[@]}"; do
    start=${SECONDS}
    # One setup at a time per venv: two CI jobs sharing the cache must not both pip into it.
    exec {lock}>"${VENVS}/torch-${version}.lock"
    flock "${lock}"
    # In a subshell of its own, not under `if`: bash ignores set -e in a function called as a
    # condition, and a failed pip must not go on to write the stamp.
    set +e
    (set -e; ensure_venv "${version}")
    rc=$?
    set -e
    if [[ ${rc} -ne 0 ]]; then
        lines+=("torch ${version}: venv setup failed (exit ${rc})")
        status=1
        exec {lock}>&-
        continue
    fi
    echo "torch ${version}: running the core tests"
    set +e
    AWS_DEFAULT_REGION=us-east-1 PYTHONPATH="${REPO_ROOT}/scripts" \
        timeout --kill-after=30 "${TIMEOUT}" \
        "${VENVS}/torch-${version}/bin/python" -m pytest -q -n 2 --dist loadgroup \
        -p no_servers_plugin "${TEST_PATHS[@]}" "$@" 2>&1 | tee "${logs}/${version}.log"
    rc=${PIPESTATUS[0]}
    set -e
    exec {lock}>&-
    [[ ${rc} -ne 0 ]] && status=1
    lines+=("$(summary "${version}" "${logs}/${version}.log" "${rc}") [$((SECONDS - start)) s]")
done
printf '%s\n' "${lines[@]}"
exit ${status}
