#!/usr/bin/env bash
# Fetch Debian packages by name and unpack them into DEST, without touching the system's apt
# state: a private sources list and private package lists, then `dpkg -x`. Used for Consul
# (bullseye is the last suite that packages it) and Prometheus with promtool. PKGS is one name,
# or several separated by spaces, all unpacked into the same tree.
set -euo pipefail
pkgs=$1 suite=$2 dest=$3
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
# An empty dpkg status too: apt must pick the suite's own version even where this machine has
# another one installed (bookworm's libjs-jquery, say, when fetching from bullseye).
: > "$work/status"
opts=(-o Dir::Etc::SourceParts=/dev/null -o Dir::Etc::sourcelist="$work/sources.list"
      -o Dir::State::Lists="$work/lists" -o Dir::Cache::Archives="$work/archives"
      -o Dir::State::status="$work/status"
      -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
echo "fetching $pkgs from Debian $suite ($uri)"
apt-get "${opts[@]}" -qq update
# shellcheck disable=SC2086 # one word per package
(cd "$work" && apt-get "${opts[@]}" -qq download $pkgs)
# Unpacked beside DEST and swapped in, so a process using the old tree (another checkout's
# tests) never finds it half-written.
rm -rf "$dest.new"
mkdir -p "$dest.new"
for pkg in $pkgs; do
  dpkg -x "$work"/"$pkg"_*.deb "$dest.new"
done
rm -rf "$dest.old"
if [ -e "$dest" ]; then mv "$dest" "$dest.old"; fi
mv "$dest.new" "$dest"
rm -rf "$dest.old"
echo "unpacked $pkgs into $dest"
