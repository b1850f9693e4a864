#!/bin/bash
# Build the kit that runs bucketfs's benchmarks on a GPU node with no network (the
# `device` machine: x86-64, Python 3.12 with torch, no pip index, a 64 MiB upload).
#
#   bash bench/node_kit/build.sh [KIT_DIR]      # default .kit (keep it git-ignored)
#
# It holds cp312 builds of the daemon's packages (pyfuse3 with bucketfs's patch, built
# here), libfuse3 and fusermount3, and SeaweedFS's `weed`, xz-compressed: ~56 MB (xz,
# not zstd: the node's image has no zstd, and Python's lzma unpacks xz anywhere).
# Needs: a Python 3.12 with headers (PY312, default `python3.12`), libfuse3-dev, xz,
# this checkout's .venv (its package versions are the ones packed).
# On the node: bash bench/node_kit/run.sh STEP... (see that file).
set -eu
KIT=${1:-.kit}
PY312=${PY312:-python3.12}
VENV_PY=${VENV_PY:-.venv/bin/python}
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
mkdir -p "$KIT" "$WORK/wheels"
version() { "$VENV_PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
PLATFORMS=""
for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
         manylinux2014 manylinux1; do PLATFORMS+=" --platform ${p}_x86_64"; done
# The daemon's dependencies and theirs that the node's torch image lacks.
for pkg in trio outcome sniffio boto3 botocore s3transfer jmespath obstore pycurl zlib-ng \
           rocksdict s3torchconnectorclient google-cloud-storage google-api-core \
           google-auth google-cloud-core google-crc32c google-resumable-media \
           googleapis-common-protos proto-plus pyasn1 pyasn1_modules cryptography cffi \
           pycparser prometheus-client; do
  "$PY312" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $PLATFORMS -d "$WORK/wheels" "$pkg==$(version "$pkg")"
done
# s3torchconnector (pure Python) is published as an sdist only.
"$PY312" -m pip wheel -q --no-deps -w "$WORK/wheels" "s3torchconnector==$(version s3torchconnector)"
"$PY312" packaging/pyfuse3/build.py --wheel-dir "$WORK/wheels"
"$PY312" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WORK"/wheels/*.whl
# botocore's models of every AWS service are 90% of the kit; S3 and its sign-in stay.
find "$WORK/site/botocore/data" -mindepth 1 -maxdepth 1 -type d \
  ! -name s3 ! -name s3control ! -name sts ! -name sso ! -name sso-oidc -exec rm -rf {} +
find "$WORK/site" -name tests -type d -prune -exec rm -rf {} +
cp "$(readlink -f /usr/lib/x86_64-linux-gnu/libfuse3.so.3)" "$WORK/site/libfuse3.so.3"
cp "$(command -v fusermount3)" "$KIT/fusermount3"
rm -f "$KIT/site.tar.zst" "$KIT/weed.zst"  # an older kit's
tar cf - -C "$WORK" site | xz -6 -T0 > "$KIT/site.tar.xz"
WEED=$("$VENV_PY" -c "import sysconfig; print(sysconfig.get_path('scripts'))")/weed
[ "$KIT/weed.xz" -nt "$WEED" ] || xz -6 -T0 < "$WEED" > "$KIT/weed.xz"
du -sh "$KIT"
