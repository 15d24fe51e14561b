#!/usr/bin/env bash
# Starts an MLflow tracking server shared by workers on several machines.
#   mlflow/server.sh [HOST] [PORT]          (defaults 127.0.0.1 5000)
# Settings come from mlflow/server.env (database backend store, artifact root; the environment overrides
# them: MLFLOW_BACKEND_STORE_URI, MLFLOW_ARTIFACTS_DIR); export CLAWPIPE_MLFLOW_TRACKING_URI=
# http://HOST:PORT on every machine that runs flows so all runs land in one place.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck disable=SC1091
source "$here/server.env"
host=${1:-127.0.0.1}; port=${2:-5000}
case "$MLFLOW_ARTIFACTS_DIR" in *://*) ;; *) mkdir -p "$MLFLOW_ARTIFACTS_DIR" ;; esac
case "$MLFLOW_BACKEND_STORE_URI" in sqlite:///*) mkdir -p "$(dirname "${MLFLOW_BACKEND_STORE_URI#sqlite:///}")" ;; esac
export MLFLOW_DISABLE_TELEMETRY=true
exec "${VENV:-$here/../.venv}/bin/mlflow" server \
  --backend-store-uri "$MLFLOW_BACKEND_STORE_URI" \
  --artifacts-destination "$MLFLOW_ARTIFACTS_DIR" \
  --host "$host" --port "$port" --workers "${MLFLOW_WORKERS:-1}"
