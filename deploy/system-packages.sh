#!/usr/bin/env bash
# The Debian packages the test suite and CI use, in one place.
#
#   deploy/system-packages.sh install   install the missing ones (root, or sudo without a
#                                       password); what .ci/run does
#   deploy/system-packages.sh auto      the same where it may, silently nothing elsewhere
#                                       (`make test` runs it before the suite)
#   deploy/system-packages.sh report    one line naming what is missing, and the command
#                                       that installs it (`make test` ends with it)
set -euo pipefail

PACKAGES=(
    # Real Fashion-MNIST for the demo, Mosquitto for the MQTT tests (started by the tests
    # themselves on free loopback ports), make for the README's commands.
    dataset-fashion-mnist mosquitto make
    # Network cameras on loopback for the camera tests: ffmpeg serves HTTP MJPEG,
    # GStreamer's RTSP server (for the system python3) serves RTSP.
    ffmpeg python3-gst-1.0 gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-good
    gstreamer1.0-plugins-base
    # Headless Chromium for the monitor's page test (tests/test_monitor.py); Prometheus and
    # promtool for the operators' stack (tests/test_operations.py).
    chromium prometheus
    # A two-node Ray cluster on loopback (tests/test_ray_cluster.py): `ip` brings up the
    # loopback of the private network namespace `unshare -n` (util-linux) gives it;
    # runuser and useradd for docs/deploy.md run as written (tests/test_deploy_doc.py).
    iproute2 util-linux passwd
    # An emulated arm64 board for deploy/check_aarch64.py: qemu through binfmt_misc, and a
    # root filesystem built from Debian's arm64 packages.
    qemu-user-static mmdebstrap arch-test
)

missing() {
    command -v dpkg-query >/dev/null 2>&1 || { printf '%s\n' "${PACKAGES[@]}"; return; }
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
            || echo "$p"
    done
}

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi
}

may_install() {
    command -v apt-get >/dev/null 2>&1 || return 1
    [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null
}

install() {
    mapfile -t todo < <(missing)
    [ "${#todo[@]}" = 0 ] && return 0
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${todo[@]}" >/dev/null
    # The packages start a system broker (1883) and Prometheus (9090); the tests start
    # their own on free ports.
    if command -v systemctl >/dev/null 2>&1; then
        as_root systemctl stop mosquitto prometheus >/dev/null 2>&1 || true
    fi
}

case "${1:-}" in
    install) install ;;
    auto) if may_install; then install; fi ;;
    report)
        mapfile -t todo < <(missing)
        if [ "${#todo[@]}" != 0 ]; then
            echo "make test: the tests needing ${todo[*]} were skipped; install them with:" \
                 "sudo deploy/system-packages.sh install"
        fi ;;
    *) echo "usage: $0 install | auto | report" >&2; exit 2 ;;
esac
