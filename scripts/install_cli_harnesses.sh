#!/usr/bin/env bash
# Installs the three real CLI harnesses (Claude Code, Codex CLI, Qwen Code) at pinned versions into the
# git-ignored folder .node/ under the repository root, for harnesses/{claude-code,codex,qwen-code}.
# Idempotent: when every package is already there at its pinned version it returns at once.
# Usage: bash scripts/install_cli_harnesses.sh [--force]      (needs node >= 20 and npm on PATH)
# CLAWPIPE_NODE_DIR overrides the target folder; CLAWPIPE_SKIP_CLI_HARNESSES=1 skips the install.
set -euo pipefail

# Pinned versions (checked on this machine's kind; see /work/shared/NOTES.md "Real CLI harnesses").
PACKAGES=(
  "@anthropic-ai/claude-code@2.1.328"
  "@openai/codex@0.169.0"
  "@qwen-code/qwen-code@0.24.4"
)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NODE_DIR="${CLAWPIPE_NODE_DIR:-$ROOT/.node}"

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

installed_version() {  # $1 = package name; prints the installed version or nothing
  local pj="$NODE_DIR/node_modules/$1/package.json"
  [ -f "$pj" ] && node -p "require('$pj').version" 2>/dev/null || true
}

missing=()
for spec in "${PACKAGES[@]}"; do
  name="${spec%@*}"
  want="${spec##*@}"
  if [ "${1:-}" = "--force" ] || [ "$(installed_version "$name")" != "$want" ]; then
    missing+=("$spec")
  fi
done
bins_ok=1
for b in claude codex qwen; do [ -x "$NODE_DIR/node_modules/.bin/$b" ] || bins_ok=0; done
if [ ${#missing[@]} -eq 0 ] && [ "$bins_ok" = 1 ]; then
  exit 0
fi
[ ${#missing[@]} -eq 0 ] && missing=("${PACKAGES[@]}")

mkdir -p "$NODE_DIR"
[ -f "$NODE_DIR/package.json" ] || echo '{"name": "clawpipe-cli-harnesses", "private": true}' >"$NODE_DIR/package.json"
echo "cli-harnesses: installing ${missing[*]} into $NODE_DIR" >&2
# --ignore-scripts is NOT used: codex and claude pick their platform binary through optional deps.
npm install --prefix "$NODE_DIR" --no-audit --no-fund --no-update-notifier --loglevel=error \
  --save-exact "${missing[@]}" >&2
# Qwen Code ships a bundled ripgrep without the execute bit (NOTES); fix it so its grep tool is fast.
find "$NODE_DIR/node_modules/@qwen-code" -path '*ripgrep*' -type f -name 'rg' -exec chmod a+x {} + 2>/dev/null || true
for b in claude codex qwen; do
  [ -x "$NODE_DIR/node_modules/.bin/$b" ] || { echo "cli-harnesses: $b missing after install" >&2; exit 1; }
done
echo "cli-harnesses: ok ($(du -sh "$NODE_DIR" | cut -f1))" >&2
