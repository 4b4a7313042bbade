#!/usr/bin/env bash
# TEST-ONLY. Never sourced or imported by hpc_rl; it provisions an interpreter for tests.
#
# NeMo Gym (PyPI `nemo-gym`) needs Python >= 3.13.14 (0.5.0 and later; 0.2-0.4 need >= 3.12),
# and the test machines run Debian bookworm, whose newest CPython is 3.11. python.org and
# GitHub may be unreachable there, deb.debian.org and PyPI are not. So this script:
#   1. debootstraps a minimal Debian sid root (its python3.13 is >= 3.13.14) into
#      $GYM_PY_DIR/root (default <repo>/.gym-python/root, git-ignored),
#   2. makes a venv /opt/gym inside that root and pip-installs nemo-gym into it,
#   3. writes $GYM_PY_DIR/bin/gym-python, which runs that root's python through bubblewrap
#      (no root needed at run time: user namespaces), sharing the host's network (loopback
#      included), /tmp and the repo.
# Building the root needs root (debootstrap); afterwards everything runs unprivileged.
# Why not building CPython from Debian's orig tarball: see the helper's report on branch i27gym
# (it needs -dev packages and a longer CPU-heavy build on 2 cores).
#
# Idempotent: each stage leaves a stamp; a finished tree is only re-checked (import test).
# Prints, as its last stdout line, the interpreter command to use.
# Env: GYM_PY_DIR, GYM_PY_SUITE (sid), GYM_PY_MIRROR, GYM_PY_PYTHON (python3.13),
#      GYM_PY_SPEC (nemo-gym==0.7.0).
set -euo pipefail

die() { echo "gym_python.sh: ERROR: $*" >&2; exit 1; }
log() { echo "gym_python.sh: $*" >&2; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${GYM_PY_DIR:-$repo/.gym-python}
suite=${GYM_PY_SUITE:-sid}
mirror=${GYM_PY_MIRROR:-http://deb.debian.org/debian}
py=${GYM_PY_PYTHON:-python3.13}
spec=${GYM_PY_SPEC:-nemo-gym==0.7.0}
root=$dir/root
wrapper=$dir/bin/gym-python

command -v bwrap >/dev/null || die "bubblewrap missing: apt-get install -y bubblewrap"
mkdir -p "$dir/bin"

# The sandbox's view: the sid root as /, the host's network, /tmp and the repo shared so
# that servers started inside answer on the host's loopback and read the same files.
# The host's CA bundle replaces the root's: some sites intercept TLS with a local CA.
write_wrapper() {
    # bwrap run unprivileged cannot create mount points in the root-owned tree: make them now
    # (bwrap run as root makes them 0700, which locks other users out: open them up)
    mkdir -p "$root$repo" || die "cannot create the mount point $root$repo (run once as the tree's owner)"
    local d=$repo
    while [ "$d" != / ]; do chmod 755 "$root$d" 2>/dev/null || true; d=$(dirname "$d"); done
    cat > "$wrapper.tmp" <<EOF
#!/usr/bin/env bash
# TEST-ONLY (written by tests/gym_python.sh): the sid root's $py with nemo-gym, via bubblewrap.
# Read-only binds at their own paths: GYM_PY_RO_BIND="dir1:dir2" (hpc_rl's Gym side sets it to the
# directories the config names: env.agentic.gym.search_dirs). Extra bind mounts: GYM_PY_BIND="src1:dst1 src2:dst2".
# The root's entries are bound one by one over bubblewrap's own tmpfs root (the empty ones left
# out), so a bind's mount point is made in that tmpfs, not in the root-owned tree: no mkdir as root.
set -euo pipefail
# Inside hpc_rl's jail (HPC_RL_JAILED, hpc_rl/envs/jail.py) the jail's own pid namespace and
# /proc serve (a nested user namespace may not mount a new proc, and a pid namespace of its
# own under the jail's /proc would show other pids than os.getpid(): Ray's psutil fails on
# that), and the repository is whatever part of it the jail shows (--bind-try: none of it,
# or the search directories it binds read-only).
extra=()
for b in \${GYM_PY_BIND:-}; do extra+=(--bind "\${b%%:*}" "\${b#*:}"); done
IFS=: read -r -a ro <<< "\${GYM_PY_RO_BIND:-}"
for d in "\${ro[@]}"; do [ -n "\$d" ] && extra+=(--ro-bind "\$d" "\$d"); done
# the root's view, entry by entry: an entry holding a bind's path becomes a tmpfs of its own
# entries (recursively), so the bind's mount point is made in a tmpfs
view=()
holds() { local d; for d in "\${ro[@]}"; do case "\$d/" in "\$1"/*) return 0;; esac; done; return 1; }
lay() {  # lay SRC_DIR DEST_DIR ("" for /)
    local e n
    for e in "\$1"/* "\$1"/.[!.]*; do
        [ -e "\$e" ] || [ -L "\$e" ] || continue
        n=\$2/\${e##*/}
        if [ -L "\$e" ]; then view+=(--symlink "\$(readlink "\$e")" "\$n")
        elif [ -d "\$e" ] && holds "\$n"; then view+=(--tmpfs "\$n"); lay "\$e" "\$n"
        elif [ -d "\$e" ]; then
            [ -n "\$2" ] || [ -n "\$(find "\$e" -maxdepth 4 -not -type d -print -quit 2>/dev/null)" ] && view+=(--bind "\$e" "\$n")
        elif [ -n "\$2" ]; then view+=(--bind "\$e" "\$n")
        fi
    done
}
lay "$root" ""
ca=()
[ -r /etc/ssl/certs/ca-certificates.crt ] && ca=(--ro-bind /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt)
proc=(--proc /proc --unshare-pid)
[ -n "\${HPC_RL_JAILED:-}" ] && proc=(--bind /proc /proc)
exec bwrap "\${view[@]}" "\${proc[@]}" --dev /dev --bind /tmp /tmp \\
    --ro-bind-try /etc/resolv.conf /etc/resolv.conf "\${ca[@]}" \\
    --bind-try "$repo" "$repo" "\${extra[@]}" --chdir "\$PWD" \\
    --die-with-parent \\
    --unsetenv PYTHONPATH --unsetenv PYTHONHOME --unsetenv VIRTUAL_ENV \\
    --unsetenv PIP_FIND_LINKS --unsetenv PIP_CONSTRAINT --unsetenv PIP_EXTRA_INDEX_URL \\
    --setenv PATH /opt/gym/bin:/usr/local/bin:/usr/bin:/bin \\
    /opt/gym/bin/python "\$@"
EOF
    chmod +x "$wrapper.tmp"
    mv "$wrapper.tmp" "$wrapper"
}

# Stage 1: the sid root with the interpreter (built in a side dir, renamed when complete).
if [ ! -e "$dir/root.stamp" ]; then
    [ "$(id -u)" = 0 ] || die "building $root needs root once (debootstrap); rerun as root, or point GYM_PY_DIR at a built tree"
    if ! command -v debootstrap >/dev/null; then
        log "installing debootstrap"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null \
            || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; } \
            || die "apt-get install debootstrap failed"
    fi
    rm -rf "$root" "$root.partial"
    log "debootstrap $suite into $root (about 80 s and 280 MB)"
    debootstrap --variant=minbase --include="$py,$py-venv,ca-certificates" \
        "$suite" "$root.partial" "$mirror" > "$dir/debootstrap.log" 2>&1 \
        || die "debootstrap $suite from $mirror failed; see $dir/debootstrap.log"
    # the downloaded .debs are not needed at run time (about 44 MB)
    rm -rf "$root.partial/var/cache/apt/archives/"*.deb
    mv "$root.partial" "$root"
    touch "$dir/root.stamp"
fi

# Stage 2: the venv and nemo-gym (pip runs inside the sandbox, without the host's pip config).
stamp_venv="$dir/venv.stamp"
if [ ! -e "$stamp_venv" ] || [ "$(cat "$stamp_venv")" != "$spec" ]; then
    write_wrapper
    ver=$(bwrap --bind "$root" / --proc /proc --dev /dev "$py" -c \
        'import sys; print("%d.%d.%d" % sys.version_info[:3])') || die "$py does not run in $root"
    [ "$(printf '%s\n' 3.13.14 "$ver" | sort -V | head -1)" = 3.13.14 ] \
        || die "$py in $root is $ver; nemo-gym 0.5+ needs >= 3.13.14 (set GYM_PY_SUITE/GYM_PY_PYTHON)"
    ca=()
    [ -r /etc/ssl/certs/ca-certificates.crt ] && ca=(--ro-bind /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt)
    run_root() {
        bwrap --bind "$root" / --proc /proc --dev /dev --tmpfs /tmp \
            --ro-bind /etc/resolv.conf /etc/resolv.conf "${ca[@]}" --unshare-pid --die-with-parent \
            --clearenv --setenv PATH /opt/gym/bin:/usr/bin:/bin --setenv HOME /tmp "$@"
    }
    rm -f "$stamp_venv"
    [ -x "$root/opt/gym/bin/python" ] || run_root "$py" -m venv /opt/gym || die "venv creation failed"
    log "pip install $spec (about 160 s and 1.4 GB)"
    run_root /opt/gym/bin/pip install --no-cache-dir --disable-pip-version-check "$spec" > "$dir/pip.log" 2>&1 \
        || die "pip install $spec failed; see $dir/pip.log"
    echo "$spec" > "$stamp_venv"
fi

write_wrapper
got=$("$wrapper" -c 'import importlib.metadata as m, sys, nemo_gym; print(sys.version.split()[0], m.version("nemo-gym"))') \
    || die "import nemo_gym failed in $root; delete $dir/venv.stamp (or $dir) to rebuild"
log "python and nemo-gym: $got"
echo "$wrapper"
