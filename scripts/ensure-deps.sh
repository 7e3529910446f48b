#!/usr/bin/env bash
# Installs what building and testing autotp needs on a fresh Debian machine, when missing:
# a C toolchain (some crates build C), LLVM 19's development files (the kernel generator links
# LLVM statically; .cargo/config.toml points llvm-sys at /usr/lib/llvm-19) and a Rust toolchain
# (cargo), Open MPI (the binary loads its library when a job of processes runs; the tests start
# such jobs with mpirun; the cluster test joins network namespaces with iproute2), and ptxas (the PyPI package nvidia-cuda-nvcc, in a venv under target/)
# for the tests that assemble the plans' PTX. Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(build-essential)
command -v curl >/dev/null 2>&1 || need_apt+=(curl ca-certificates)
[ -x /usr/lib/llvm-19/bin/llvm-config ] || need_apt+=(llvm-19-dev libpolly-19-dev)
command -v mpirun >/dev/null 2>&1 || need_apt+=(openmpi-bin)
# `ip` (network namespaces) and `unshare`: the cluster test's nodes.
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v unshare >/dev/null 2>&1 || need_apt+=(util-linux)
command -v python3 >/dev/null 2>&1 || need_apt+=(python3)
python3 -c "import ensurepip" >/dev/null 2>&1 || need_apt+=(python3-venv)
for header in /usr/include/zstd.h /usr/include/zlib.h /usr/include/libxml2/libxml/parser.h; do
  [ -e "$header" ] || { need_apt+=(libzstd-dev zlib1g-dev libxml2-dev); break; }
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "ensure-deps: installing ${need_apt[*]}" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
  echo "ensure-deps: installing the Rust toolchain with rustup" >&2
  curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
  echo "ensure-deps: open a new shell or run 'source \$HOME/.cargo/env' to put cargo on PATH" >&2
fi

PTXAS_VENV=target/ptxas-venv
if ! ls "$PTXAS_VENV"/lib/python3*/site-packages/nvidia/*/bin/ptxas >/dev/null 2>&1; then
  echo "ensure-deps: installing ptxas (nvidia-cuda-nvcc 13.0) into $PTXAS_VENV" >&2
  python3 -m venv "$PTXAS_VENV"
  "$PTXAS_VENV/bin/pip" install -q "nvidia-cuda-nvcc==13.0.*"
fi
