# shellcheck shell=bash
# The interpreter and platform the image's wheels are for (sourced by lock.sh and build.sh):
# Debian bookworm's CPython 3.11 on x86_64 with glibc 2.36, so any manylinux wheel up to
# manylinux_2_36. pip's --platform takes each tag literally, hence the whole list.
PY_VERSION=3.11
PLATFORM_ARCH=x86_64
WHEEL_TARGET=(--only-binary=:all: --implementation cp --python-version "$PY_VERSION"
	--abi cp311 --abi abi3 --abi none)
for minor in $(seq 36 -1 5); do
	WHEEL_TARGET+=(--platform "manylinux_2_${minor}_$PLATFORM_ARCH")
done
WHEEL_TARGET+=(--platform manylinux2014_$PLATFORM_ARCH --platform manylinux2010_$PLATFORM_ARCH
	--platform manylinux1_$PLATFORM_ARCH --platform any)
