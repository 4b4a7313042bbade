#!/usr/bin/env bash
# Turn a container image into an enroot squashfs that pyxis mounts on every rank:
#
#   containers/build_sqsh.sh dockerd://hpc_rl:arm64 /lustre/images/hpc_rl-arm64.sqsh
#   containers/build_sqsh.sh docker://nvcr.io#nvidia/pytorch:25.01-py3 ./base.sqsh
#
# Then launch with the absolute (or ./-relative) path; pyxis reads any other name as a
# registry image and tries to pull it:
#
#   python -m hpc_rl.launch +recipe=ultra_mopd launcher=slurm container.image=/lustre/images/hpc_rl-arm64.sqsh
#
# Build on a node of the target architecture (GB200: aarch64), or import the image that
# `docker buildx build --platform` produced for it.
set -euo pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 <image uri: dockerd://name:tag | docker://registry#image:tag> <output.sqsh>" >&2
    exit 2
fi
src=$1
out=$2
case "$out" in
    /*|./*) ;;
    *) echo "output '$out' must start with / or ./ (pyxis treats other names as registry images)" >&2; exit 2 ;;
esac
command -v enroot >/dev/null || { echo "enroot is not installed on this node (https://github.com/NVIDIA/enroot)" >&2; exit 1; }

mkdir -p "$(dirname "$out")"
tmp="$out.partial.$$"
trap 'rm -f "$tmp"' EXIT
# enroot writes the squashfs; rename only when complete so jobs never mount half an image
enroot import --output "$tmp" "$src"
mv "$tmp" "$out"
trap - EXIT
echo "wrote $out ($(du -h "$out" | cut -f1))"
