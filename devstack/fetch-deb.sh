#!/usr/bin/env bash
# Fetch one Debian package by name and unpack it into DEST, without touching the system's apt
# state: a private sources list and private package lists, then `dpkg -x`. Used for Consul
# (bullseye is the last suite that packages it) and promtool.
set -euo pipefail
pkg=$1 suite=$2 dest=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The same mirror the machine's own apt uses, so no other host is needed.
uri=$(grep -h -m1 -E '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' || true)
if [ -z "$uri" ]; then
  uri=$(grep -h -m1 -E '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' || true)
fi
uri=${uri:-http://deb.debian.org/debian}

mkdir -p "$work/lists/partial" "$work/archives/partial"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $uri $suite main" > "$work/sources.list"
opts=(-o Dir::Etc::SourceParts=/dev/null -o Dir::Etc::sourcelist="$work/sources.list"
      -o Dir::State::Lists="$work/lists" -o Dir::Cache::Archives="$work/archives"
      -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
echo "fetching $pkg from Debian $suite ($uri)"
apt-get "${opts[@]}" -qq update
(cd "$work" && apt-get "${opts[@]}" -qq download "$pkg")
rm -rf "$dest"
mkdir -p "$dest"
dpkg -x "$work"/"$pkg"_*.deb "$dest"
echo "unpacked $pkg into $dest"
