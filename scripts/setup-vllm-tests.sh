#!/usr/bin/env bash
# vLLM's own offloading tests, for tests/vllm_upstream/ (they run on kvtier's spec there; nothing
# of vLLM's is committed). For each version: vLLM's source archive from PyPI (curl: pip would try
# to build an sdist), its sha256 checked against the pin below, and only the test files that
# kvtier runs extracted into .vllm-tests/<version>/: tests/v1/kv_offload/,
# tests/v1/kv_connector/unit/offloading_connector/ and what they import (the packages'
# __init__.py, tests/v1/kv_connector/unit/{utils,conftest}.py). Idempotent: a version whose
# completion marker exists is skipped.
set -euo pipefail
DEST=${VLLM_TESTS:-.vllm-tests}
VERSIONS=${VLLM_TESTS_VERSIONS:-"0.32.0 0.33.0"}
INDEX=${VLLM_TESTS_INDEX:-https://pypi.org/simple/vllm/}

sha256_of() {
    case "$1" in
        0.32.0) echo d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad ;;
        0.33.0) echo f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112 ;;
        *) echo "setup-vllm-tests: no sha256 pinned for vLLM $1" >&2; return 1 ;;
    esac
}

todo=""
for v in $VERSIONS; do
    [ -f "$DEST/$v/.complete" ] || todo="$todo $v"
done
[ -z "$todo" ] && exit 0

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
curl -sSfL --retry 3 -o "$tmp/index.html" "$INDEX"
for v in $todo; do
    want=$(sha256_of "$v")
    url=$(grep -o "href=\"[^\"]*/vllm-$v\.tar\.gz#sha256=[0-9a-f]*\"" "$tmp/index.html" | head -n1 \
          | sed -e 's/^href="//' -e 's/"$//')
    if [ -z "$url" ]; then
        echo "setup-vllm-tests: vllm-$v.tar.gz is not in $INDEX" >&2
        exit 1
    fi
    if [ "${url##*#sha256=}" != "$want" ]; then
        echo "setup-vllm-tests: the index's sha256 of vllm-$v.tar.gz (${url##*#sha256=}) is not the pinned $want" >&2
        exit 1
    fi
    curl -sSfL --retry 3 -o "$tmp/vllm-$v.tar.gz" "${url%%#*}"
    got=$(sha256sum "$tmp/vllm-$v.tar.gz" | cut -d' ' -f1)
    if [ "$got" != "$want" ]; then
        echo "setup-vllm-tests: vllm-$v.tar.gz has sha256 $got, want $want" >&2
        exit 1
    fi
    rm -rf "$DEST/$v.partial"
    mkdir -p "$DEST/$v.partial"
    p="vllm-$v/tests"
    tar -xzf "$tmp/vllm-$v.tar.gz" -C "$DEST/$v.partial" --strip-components=1 --wildcards \
        "$p/__init__.py" "$p/v1/__init__.py" "$p/v1/kv_connector/__init__.py" \
        "$p/v1/kv_connector/unit/__init__.py" "$p/v1/kv_connector/unit/utils.py" \
        "$p/v1/kv_connector/unit/conftest.py" \
        "$p/v1/kv_connector/unit/offloading_connector/*" "$p/v1/kv_offload/*"
    rm -rf "$DEST/$v"
    mv "$DEST/$v.partial" "$DEST/$v"
    touch "$DEST/$v/.complete"
    echo "vLLM $v's offloading tests in $DEST/$v"
done
