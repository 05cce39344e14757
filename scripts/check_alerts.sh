#!/usr/bin/env bash
# promtool checks of the shipped Prometheus alert rules (part of scripts/test.sh):
# `promtool check rules` and the rules' unit tests (`promtool test rules`).
# Without promtool it installs Debian's prometheus package when apt works (as
# root or with passwordless sudo); when it cannot, it says so and skips (exit 0).
# Exits non-zero when a check fails.
set -euo pipefail
folder=$(cd "$(dirname "$0")/../examples/observability/kv_checksum" && pwd)

install_promtool() {
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        sudo -n true 2>/dev/null || return 1
        sudo="sudo -n"
    fi
    command -v apt-get >/dev/null 2>&1 || return 1
    $sudo apt-get update &&
        $sudo env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y --no-install-recommends prometheus
}

if ! command -v promtool >/dev/null 2>&1; then
    log=$(mktemp "${TMPDIR:-/tmp}/kv-checksum-promtool-XXXXXX.log")
    echo "promtool not found: trying to install Debian's prometheus package (log: $log)"
    if ! install_promtool >"$log" 2>&1 || ! command -v promtool >/dev/null 2>&1; then
        echo "SKIPPED the promtool checks of the alert rules: promtool is missing" \
            "and apt could not install it (log: $log)"
        exit 0
    fi
fi
promtool check rules "$folder/alerts.yaml"
cd "$folder" && promtool test rules alerts_test.yaml
