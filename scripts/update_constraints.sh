#!/usr/bin/env bash
# Regenerate constraints.txt: resolve the README's test install (the package, its `test` and
# `litgpt` extras, torch 2.13.0) in a brand-new virtual environment without the old pins, then
# pin exactly what pip chose. Run it when a dependency should move; commit the diff with the
# date, and let CI prove the new set (docs/decisions.md, "Dependencies").
set -euo pipefail
cd "$(dirname "$0")/.."
TMP="$(mktemp -d "${TMPDIR:-/tmp}/mfsdp-constraints.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
PYTHON="$(command -v python3 || command -v python)"
"$PYTHON" -m venv "$TMP/venv"
"$TMP/venv/bin/python" -m pip install --quiet --upgrade pip
"$TMP/venv/bin/python" -m pip install --quiet torch==2.13.0 -e ".[test,litgpt]"
{
  echo "# Known-good versions of every package the README's two commands install (Python 3.11, CPU)."
  echo "# Both commands pass it with -c, so a release published after this date changes nothing until"
  echo "# this file is regenerated: scripts/update_constraints.sh (docs/decisions.md, \"Dependencies\")."
  echo "# Resolved $(date -u +%Y-%m-%d) in a fresh virtual environment by $("$TMP/venv/bin/python" -m pip --version | cut -d' ' -f1-2)."
  # The package itself is installed editable and never pinned; torch's local label (+cpu) is
  # dropped so the pin also matches the build a GPU machine has.
  "$TMP/venv/bin/python" -m pip freeze --exclude-editable | grep -v '^#' | sed -E 's/^(torch==[^+]+)\+.*/\1/'
} > constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) pins"
