#!/usr/bin/env bash
# Install the Debian packages whose Rust sources make up the training corpus.
# rust-src (the Rust standard library, MIT/Apache-2.0) is the whole corpus; a few crate-source
# packages (librust-*-dev, also permissively licensed) are added when M31R_EXTRA_CRATES=1.
# Prints the source roots to pass to `m31r train corpus`.
set -euo pipefail

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

EXTRA_CRATES=(
  librust-serde-dev librust-regex-dev librust-syn-dev librust-itertools-dev
  librust-anyhow-dev librust-thiserror-dev librust-log-dev librust-bitflags-dev
)

if ! apt-cache policy rust-src 2>/dev/null | grep -q 'Candidate: [0-9]'; then
  $SUDO apt-get update
fi
pkgs=(rust-src)
if [ "${M31R_EXTRA_CRATES:-0}" = "1" ]; then pkgs+=("${EXTRA_CRATES[@]}"); fi
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends "${pkgs[@]}"

# Where Debian puts the sources: rust-src under /usr/lib/rustlib/src/rust, crates under
# /usr/share/cargo/registry.
roots=()
for d in /usr/lib/rustlib/src/rust /usr/share/cargo/registry; do
  if [ -d "$d" ]; then roots+=("$d"); fi
done
dpkg-query -W -f '${Package} ${Version}\n' "${pkgs[@]}"
printf 'source root: %s\n' "${roots[@]}"
