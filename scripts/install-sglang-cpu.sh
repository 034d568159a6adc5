#!/usr/bin/env bash
# Make a CPU-only venv able to import one sglang release's multimodal_gen attention layer
# (sglang.multimodal_gen.runtime.layers.attention.layer.USPAttention), for `parity check --target sglang`.
#
#   bash scripts/install-sglang-cpu.sh                  # the default release (the one CI runs), into
#                                                       # $VIRTUAL_ENV if set, else <checkout>/.venv
#   bash scripts/install-sglang-cpu.sh --version 0.5.17 # another release (--list: those known)
#   bash scripts/install-sglang-cpu.sh --verify         # also import the layer when nothing needed installing
#
# torch is never replaced (sglang pins another one): every package that would pull it in is
# installed with --no-deps, and pip runs under a constraint pinning the torch already there.
# What each release needs (scripts/sglang_cpu/releases.toml), what is installed and why, and the
# stand-ins the .pth file wires in: scripts/sglang_cpu/README.md. One venv per release: switching
# a venv to another release leaves the first one's extra packages behind.
# Idempotent: when every package is at its pinned version and the .pth file is in place, it
# exits within a second without calling pip.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
checkout="$(dirname "$here")"
files="$here/sglang_cpu"
layer="sglang.multimodal_gen.runtime.layers.attention.layer"
verify=0
release=()
while [ $# -gt 0 ]; do
  case "$1" in
    --verify) verify=1 ;;
    --version) [ $# -ge 2 ] || { echo "install-sglang-cpu: --version needs a release (--list: those known)" >&2; exit 2; }
               release=(--version "$2"); shift ;;
    --version=*) release=(--version "${1#--version=}") ;;
    --list) exec python3 "$files/resolve.py" --list ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "install-sglang-cpu: unknown argument '$1' (--version V, --list, --verify)" >&2; exit 2 ;;
  esac
  shift
done

if [ -n "${VIRTUAL_ENV:-}" ]; then
  venv="$VIRTUAL_ENV"; why="\$VIRTUAL_ENV"
else
  venv="$checkout/.venv"; why="no \$VIRTUAL_ENV set, the checkout's .venv"
fi
py="$venv/bin/python"
if [ ! -x "$py" ]; then
  echo "install-sglang-cpu: no Python at $py ($why); create the venv first (see README.md, Quick start)" >&2
  exit 2
fi
echo "install-sglang-cpu: venv $venv ($why)"

torch_of() { "$py" -c 'from importlib.metadata import version; print(version("torch"))' 2>/dev/null; }
torch_version="$(torch_of)" || {
  echo "install-sglang-cpu: torch is not installed in $venv; install it first (pip install torch==2.13.0)" >&2
  exit 2
}
reqs="$(mktemp -d)"; trap 'rm -rf "$reqs"' EXIT
wanted="$("$py" "$files/resolve.py" "${release[@]}" "$reqs")" || exit 2
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
pth="$site/parity-sglang-cpu.pth"
pth_text="$files/boot
import parity_sglang_cpu"

# Every line of both requirement files satisfied (name==version where pinned, present otherwise)?
missing="$("$py" - "$reqs/requirements.txt" "$reqs/requirements-no-deps.txt" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

for path in sys.argv[1:]:
    for line in open(path):
        req = line.split("#", 1)[0].strip()
        if not req:
            continue
        name, _, pinned = req.partition("==")
        try:
            have = version(name)
        except PackageNotFoundError:
            have = None
        if have is None or (pinned and have != pinned):
            print(f"{req} (have {have or 'none'})")
EOF
)"
if [ -z "$missing" ] && [ "$(cat "$pth" 2>/dev/null)" = "$pth_text" ] && [ "$verify" = 0 ]; then
  echo "install-sglang-cpu: already installed (sglang $("$py" -c 'from importlib.metadata import version; print(version("sglang"))'), torch $torch_version); --verify imports the layer"
  exit 0
fi

if [ -n "$missing" ]; then
  echo "install-sglang-cpu: installing for sglang $wanted:"; echo "$missing" | sed 's/^/  /'
  constraint="$reqs/constraint.txt"
  echo "torch==$torch_version" >"$constraint"
  start=$SECONDS
  # pip's resolver warns about sglang's unmet (deliberately uninstalled) requirements: not an error.
  "$venv/bin/pip" install -q -c "$constraint" -r "$reqs/requirements.txt" 2>&1 | { grep -v -e '^WARNING: Location' -e 'requires' -e "dependency resolver" -e 'which is incompatible' || true; }
  "$venv/bin/pip" install -q --no-deps -c "$constraint" -r "$reqs/requirements-no-deps.txt" 2>&1 | { grep -v -e '^WARNING: Location' -e 'requires' -e "dependency resolver" -e 'which is incompatible' || true; }
  echo "install-sglang-cpu: pip took $((SECONDS - start)) s"
fi
if [ "$(cat "$pth" 2>/dev/null)" != "$pth_text" ]; then
  printf '%s\n' "$pth_text" >"$pth"
  echo "install-sglang-cpu: wrote $pth (stand-ins from $files)"
fi

after="$(torch_of)"
if [ "$after" != "$torch_version" ]; then
  echo "install-sglang-cpu: torch changed from $torch_version to $after: this must not happen" >&2
  exit 1
fi
"$py" -W ignore - "$layer" <<'EOF'
import importlib, sys, time
from importlib.metadata import version

start = time.perf_counter()
module = importlib.import_module(sys.argv[1])
took = time.perf_counter() - start
count = sum(name.startswith("sglang") for name in sys.modules)
print(f"install-sglang-cpu: ok: sglang {version('sglang')} {module.USPAttention.__name__} imports in {took:.1f} s ({count} sglang modules)")
EOF
