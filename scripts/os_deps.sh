#!/usr/bin/env bash
# Installs the OS packages clawpipe needs when they are missing: bubblewrap (default sandbox),
# docker.io (Docker backend, docker-marked tests), procps (kill, for the sandbox uid sweep), curl (the
# proxy's tests drive it as a client), and gcc with Python's headers (the install compiles landing's reader
# of OpenAI bodies, clawpipe/lake/_openai_scan.c; without them it installs, and lands more slowly).
# As root it uses apt-get; otherwise it says what to run.
set -u
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
[ -x /usr/bin/kill ] || [ -x /bin/kill ] || missing+=(procps)  # the sandbox uid sweep's kill(-1) helper
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v cc >/dev/null 2>&1 || missing+=(gcc)
"${PYTHON:-python3}" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
  || missing+=(python3-dev)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "os-deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null && apt-get install -y -qq "${missing[@]}" >/dev/null || {
    echo "os-deps: apt-get install ${missing[*]} failed" >&2; exit 1; }
else
  echo "os-deps: missing ${missing[*]}; install with: sudo apt-get install -y ${missing[*]}" >&2
  echo "os-deps: continuing; sandbox/docker features that need them will say so" >&2
fi
