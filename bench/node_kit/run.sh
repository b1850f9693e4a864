#!/bin/bash
# On a GPU node with no network: unpack the kit that build.sh made (carried as .kit),
# then run the benchmarks named, each cut off so that all end by DEADLINE seconds.
#
#   set -o pipefail; DEADLINE=545 bash bench/node_kit/run.sh clones dataplane \
#       2>&1 | tee $OUT/log.txt            # the `device` tool: carry [".kit"]
#
# STEP: smoke (a 200-file dataplane) | dataplane (also a mount with DP_PROCS=4 data
# processes) | gpu | placement | gets (the GET engine
# against obstore, bench.large_gets) | clones (more than one serving process on one FUSE
# connection, bench.fuse_clones: clones splitting a cache, and one process dispatching
# reads to minimal repliers and to bucketfs's data processes) | clones64 (the same with 64
# readers and 4 or 8 processes). Results go to $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=${PY:-python3}
t0=$(date +%s)
# Python's lzma unpacks the kit: the node's image has no zstd.
unpack() { $PY -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$@"; }
if [ ! -d /tmp/site ]; then
  unpack .kit/site.tar.xz /tmp/site.tar && tar xf /tmp/site.tar -C /tmp && rm /tmp/site.tar
  unpack .kit/weed.xz /tmp/site/bin/weed && chmod +x /tmp/site/bin/weed
  cp .kit/fusermount3 /tmp/site/bin/ && chmod +x /tmp/site/bin/fusermount3
fi
for p in prefetch hints; do [ -e bucketfs/$p ] || ln -s ../$p bucketfs/$p; done
export PYTHONPATH=$PWD:/tmp/site${EXTRA_PATH:+:$EXTRA_PATH}
export LD_LIBRARY_PATH=/tmp/site
export PATH=/tmp/site/bin:$PATH
export BUCKETFS_TEST_WEED=/tmp/site/bin/weed
echo "setup $(( $(date +%s) - t0 )) s; $(nproc) cores; $($PY --version)"
$PY -c "import pyfuse3, bucketfs.hints, obstore, pycurl, rocksdict, trio; print('pyfuse3 patch', pyfuse3.BUCKETFS_PATCH)" || exit 1
DEADLINE=${DEADLINE:-540}   # seconds after t0 by which every step must have ended
for step in "$@"; do
  s=$(date +%s); left=$(( DEADLINE - (s - t0) - 5 ))
  if [ $left -lt 60 ]; then echo "=== $step skipped: ${left} s left"; continue; fi
  echo "=== $step $(date +%T), at most ${left} s"
  case $step in
    smoke) timeout $left $PY -m bench.dataplane --files 200 --large-mib 32 --scale 16 --data-processes 2 --out "$OUT/smoke" ;;
    dataplane) timeout $(( left < ${DP_LIMIT:-300} ? left : ${DP_LIMIT:-300} )) $PY -m bench.dataplane --files 4000 --large-mib 1024 --scale 16,64 --data-processes ${DP_PROCS:-4} --out "$OUT" ;;
    gpu) timeout $(( left < ${GPU_LIMIT:-240} ? left : ${GPU_LIMIT:-240} )) $PY -m bench.gpu_epoch --images 16384 --epochs 2 --workers 12 --out "$OUT" ;;
    placement) timeout $left $PY -m bench.placement --files 4000 --rounds 1 --variants all,cpus4,cpus2 --out "$OUT" ;;
    gets) timeout $(( left < 120 ? left : 120 )) $PY -m bench.large_gets --mib 1024 --rounds 2 --out "$OUT" ;;
    clones) timeout $(( left < 300 ? left : 300 )) $PY -m bench.fuse_clones --files 4000 --procs 1,2,4,8 --sources owned,dispatch,dispatch-bucketfs,dispatch-bucketfs-ssd --out "$OUT" ;;
    # Whether more readers lift the ~4,000 files/s every shape stopped at with 16.
    clones64) timeout $(( left < 240 ? left : 240 )) $PY -m bench.fuse_clones --files 8000 --readers 64 --procs 4,8 --sources owned,dispatch,dispatch-bucketfs --out "$OUT" ;;
  esac
  echo "=== $step rc=$? $(( $(date +%s) - s )) s"
done
