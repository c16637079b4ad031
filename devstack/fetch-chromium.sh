#!/usr/bin/env bash
# Fetch Debian's chromium, and whichever of its libraries this machine lacks, and unpack them
# into DEST without touching the system's apt or dpkg state, like fetch-deb.sh does for Consul.
# DEST/chromium is a wrapper that runs the unpacked browser with the unpacked libraries; the
# browser tests hand it to Playwright as its executable (Playwright's own download is never used).
#
# Which libraries are missing is apt's own answer for this machine (a simulated install against
# the system's dpkg status), so a machine with more installed downloads less.
set -euo pipefail
dest=$(realpath -m "$1")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mkdir -p "$work/lists/partial" "$work/archives/partial"
# The machine's own sources (its suites and security updates, which chromium follows closely),
# read into private lists.
opts=(-o Dir::State::Lists="$work/lists" -o Dir::Cache::Archives="$work/archives"
      -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
echo "fetching chromium and the libraries it needs that are not installed here"
apt-get "${opts[@]}" -qq update
missing=$(apt-get "${opts[@]}" -s --no-install-recommends install chromium \
  | awk '/^Inst /{print $2}')
# chromium itself even when installed system-wide: the cache must not depend on that staying so.
pkgs=$(printf '%s\n' chromium chromium-common $missing | sort -u)
# shellcheck disable=SC2086 # one word per package
(cd "$work" && apt-get "${opts[@]}" -qq download $pkgs)
# Unpacked beside DEST and swapped in, so a test using the old browser never finds it half-written.
new="$dest.new"
rm -rf "$new"
mkdir -p "$new/root"
for deb in "$work"/*.deb; do
  dpkg -x "$deb" "$new/root"
done

libdirs=$(cd "$new/root" && find . -name '*.so*' -printf "$dest/root/%h\n" | sed 's|/\./|/|' | sort -u | tr '\n' ':')
cat > "$new/chromium" <<EOF
#!/usr/bin/env bash
# Debian's chromium unpacked by devstack/fetch-chromium.sh, run with its unpacked libraries.
export LD_LIBRARY_PATH="${libdirs}\${LD_LIBRARY_PATH:-}"
exec "$dest/root/usr/lib/chromium/chromium" "\$@"
EOF
chmod +x "$new/chromium"
rm -rf "$dest.old"
if [ -e "$dest" ]; then mv "$dest" "$dest.old"; fi
mv "$new" "$dest"
rm -rf "$dest.old"
"$dest/chromium" --headless --no-sandbox --disable-gpu --version
echo "unpacked chromium into $dest (run $dest/chromium)"
