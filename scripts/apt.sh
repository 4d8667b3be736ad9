# Debian packages for scripts/setup.sh, sourced: `apt_install WHY [OPTION...] PKG...`.
# Says what it installs, waits (bounded: APT_LOCK_WAIT seconds, default 600) for another apt
# or dpkg that holds the lock, and fails naming each package that could not be installed.
# Installs as root, else with sudo (APT_SUDO: the command, e.g. "sudo -n"; default "sudo").

_apt_updated=""
_apt_lock_re='Could not get lock|Unable to acquire the dpkg frontend lock|Unable to lock'

apt_missing() {  # the packages of "$@" that are not installed
    local p
    for p in "$@"; do
        [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || echo "$p"
    done
}

# apt-get "$@", waiting while another apt or dpkg holds a lock: apt's own
# DPkg::Lock::Timeout covers dpkg's lock but not `update`'s lists lock, so we retry on it too.
_apt_get() {
    local wait_s="${APT_LOCK_WAIT:-600}" said="" log rc=0
    local deadline=$((SECONDS + wait_s))
    local -a sudo=()
    [ "$(id -u)" -eq 0 ] || read -r -a sudo <<<"${APT_SUDO:-sudo}"
    log="$(mktemp)"
    while :; do
        rc=0
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get \
            -o DPkg::Lock::Timeout="$((deadline > SECONDS ? deadline - SECONDS : 0))" "$@" >"$log" 2>&1 || rc=$?
        if [ "$rc" -eq 0 ]; then
            rm -f "$log"
            return 0
        fi
        if grep -Eq "$_apt_lock_re" "$log" && [ "$SECONDS" -lt "$deadline" ]; then
            [ -n "$said" ] || echo "setup: another apt or dpkg holds the lock; waiting up to ${wait_s} s:" \
                "$(grep -Em1 "$_apt_lock_re" "$log")" >&2
            said=1
            sleep "${APT_LOCK_POLL:-5}"
            continue
        fi
        grep -Eq "$_apt_lock_re" "$log" && echo "setup: apt's lock still held after ${wait_s} s" >&2
        tail -n 20 "$log" >&2
        rm -f "$log"
        return "$rc"
    done
}

apt_install() {
    local why="$1" p
    shift
    local -a opts=() pkgs=() missing=() failed=()
    for p in "$@"; do
        if [[ "$p" == -* ]]; then opts+=("$p"); else pkgs+=("$p"); fi
    done
    mapfile -t missing < <(apt_missing "${pkgs[@]}")
    [ "${#missing[@]}" -gt 0 ] || return 0
    echo "setup: installing Debian's ${missing[*]} ($why)" >&2
    if [ -z "$_apt_updated" ]; then
        _apt_get update -qq || { echo "setup: error: apt-get update failed (needed for ${missing[*]})" >&2; return 1; }
        _apt_updated=1
    fi
    _apt_get install -y -qq "${opts[@]}" "${missing[@]}" && return 0
    # Which one: each that is still missing, alone.
    mapfile -t missing < <(apt_missing "${missing[@]}")
    for p in "${missing[@]}"; do
        _apt_get install -y -qq "${opts[@]}" "$p" || failed+=("$p")
    done
    if [ "${#failed[@]}" -gt 0 ]; then
        echo "setup: error: could not install Debian's ${failed[*]} ($why): apt-get's messages above" >&2
        return 1
    fi
}
