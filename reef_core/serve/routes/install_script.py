"""The POSIX ``sh`` script of ``GET /reef/harness/install``: installs one release's rendered tree and the
``reef-<adapter>`` wrapper (``curl -fsS .../reef/harness/install?adapter=generic | sh``, or ``sh install.sh [DEST]
[PREFIX]``; defaults ``./reef-harness`` and ``${XDG_DATA_HOME:-$HOME/.local/share}/reef``).

What the script does, in order (every file it writes goes through a temporary file and a rename):

1. ``set -eu``; pick ``sha256sum`` or ``shasum -a 256``; find a Python that imports ``reef_core.client.wrapper``
   (``reef-core[client]``; ``REEF_PYTHON`` wins) for the wrapper.
2. Stage every file in a temporary directory, each written byte-exact by a single-quoted heredoc whose delimiter
   is derived from the content (so no line of a file can end it; a file without a final newline is trimmed to its
   length with ``dd``), then check each file's SHA-256 and one SHA-256 over the whole tree (``path LF length LF
   bytes`` frames, in order): a mismatch (a damaged or edited script) exits 1 before anything is installed.
3. If every installed file, the sidecar and the wrapper already match, say so and write nothing.
4. Delete the files the previous sidecar listed that this release lacks, write the changed files, then the
   ``.reef-harness-release`` sidecar (:mod:`reef_core.client.tree`), then the wrapper in ``PREFIX/bin`` with a link
   in ``${REEF_BIN_DIR:-$HOME/.local/bin}``.

The wrapper exports where Reef is, the scenario, the adapter, the install directory and the adapter's environment,
then runs ``python -m reef_core.client.wrapper``. No token is written: the wrapper reads ``REEF_TOKEN``.
"""

from __future__ import annotations

import hashlib

from reef_core.client.tree import SIDECAR, sidecar_text, sorted_paths, tree_digest
from reef_core.errors import Conflict


def sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def _delimiter(tag: str, data: bytes) -> str:
    lines = set(data.split(b"\n"))
    stem = f"REEF_{tag}_{hashlib.sha256(data).hexdigest()[:16]}"
    delimiter, n = stem, 0
    while delimiter.encode() in lines:  # practically never: the content would hold its own digest
        n += 1
        delimiter = f"{stem}_{n}"
    return delimiter


def _heredoc(target: str, tag: str, data: bytes) -> list[str]:
    """Lines writing ``data`` byte-exact to ``target`` (a shell word)."""
    if not data:
        return [f": > {target}"]
    body = data.decode("utf-8")
    delimiter = _delimiter(tag, data)
    lines = [f"cat > {target} <<'{delimiter}'", body + ("" if body.endswith("\n") else "\n") + delimiter]
    if not body.endswith("\n"):
        lines.append(f"trim {target} {len(data)}")
    return lines


def _env_value(template: str) -> str:
    """A shell expression of an adapter's environment value, ``{dir}`` standing for the absolute install dir."""
    parts = template.split("{dir}")
    out = []
    for i, part in enumerate(parts):
        if i:
            out.append('"$ABS"')
        if part:
            out.append(sh_quote(part))
    return "".join(out) or "''"


def _check_path(path: str) -> None:
    # The script reads its file list with `read`, which trims blanks at both ends of a line.
    if path != path.strip():
        raise Conflict(f"harness path {path!r} has leading or trailing whitespace; it cannot be installed")


_PRELUDE = r'''set -eu
umask 022
say() { printf 'reef-install: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }
if command -v sha256sum >/dev/null 2>&1; then
  sha() { sha256sum < "$1" | cut -d' ' -f1; }
elif command -v shasum >/dev/null 2>&1; then
  sha() { shasum -a 256 < "$1" | cut -d' ' -f1; }
else
  die "needs sha256sum or shasum"
fi
shq() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }
trim() {
  dd if="$1" of="$1.trim" bs="$2" count=1 2>/dev/null
  mv -f "$1.trim" "$1"
}
put() {
  # put SOURCE TARGET: replace TARGET through a temporary file and a rename
  mkdir -p "$(dirname "$2")"
  cp "$1" "$2.reef-new"
  mv -f "$2.reef-new" "$2"
}
DEST=${1:-./reef-harness}
PREFIX=${2:-${XDG_DATA_HOME:-$HOME/.local/share}/reef}
BIN=${REEF_BIN_DIR:-$HOME/.local/bin}
case "$DEST" in /*) ABS=$DEST ;; *) ABS=$(pwd)/$DEST ;; esac
case "$PREFIX" in /*) ;; *) PREFIX=$(pwd)/$PREFIX ;; esac
PY=${REEF_PYTHON:-}
NEEDS='import reef_core.client.wrapper'
if [ -z "$PY" ]; then
  for candidate in python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "$NEEDS" >/dev/null 2>&1; then
      PY=$(command -v "$candidate")
      break
    fi
  done
fi
if [ -z "$PY" ] || ! "$PY" -c "$NEEDS" >/dev/null 2>&1; then
  die "no Python importing reef_core.client.wrapper: pip install 'reef-core[client]', or set REEF_PYTHON"
fi
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/reef-install.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
trap 'exit 1' HUP INT TERM
'''

_CHECK = r'''files | while read -r i h n p; do
  [ "$(sha "$STAGE/f$i")" = "$h" ] || { say "checksum mismatch for $p: the script is damaged"; exit 1; }
done || exit 1
files | while read -r i h n p; do printf '%s\n%s\n' "$p" "$n"; cat "$STAGE/f$i"; done > "$STAGE/tree"
[ "$(sha "$STAGE/tree")" = "$TREE_SHA256" ] || die "tree checksum mismatch: the script is damaged"
[ "$(sha "$STAGE/sidecar")" = "$SIDECAR_SHA256" ] || die "sidecar checksum mismatch: the script is damaged"
{
  printf '#!/bin/sh\n# reef-%s: runs the agent through the Reef capture proxy (written by the installer)\n' "$ADAPTER"
  # shellcheck disable=SC2016 # the wrapper expands it, when it runs
  printf 'REEF_URL=${REEF_URL:-%s}\n' "$(shq "$REEF_URL_BAKED")"
  printf 'export REEF_URL\n'
  printf 'export REEF_SCENARIO=%s\n' "$(shq "$SCENARIO")"
  printf 'export REEF_ADAPTER=%s\n' "$(shq "$ADAPTER")"
  printf 'export REEF_HARNESS_DIR=%s\n' "$(shq "$ABS")"
  printf 'export REEF_AGENT=%s\n' "$(shq "$AGENT")"
  printf 'export REEF_PREFIX=%s\n' "$(shq "$PREFIX")"
  printf 'export REEF_BIN_DIR=%s\n' "$(shq "$BIN")"
  environment
  printf 'exec %s -m reef_core.client.wrapper "$@"\n' "$(shq "$PY")"
} > "$STAGE/wrapper"
WRAPPER=$PREFIX/bin/reef-$ADAPTER
LINK=$BIN/reef-$ADAPTER

current=yes
[ -f "$DEST/$SIDECAR" ] && [ "$(sha "$DEST/$SIDECAR")" = "$SIDECAR_SHA256" ] || current=no
if [ "$current" = yes ]; then
  files | while read -r i h n p; do
    [ -f "$DEST/$p" ] && [ "$(sha "$DEST/$p")" = "$h" ] || exit 1
  done || current=no
fi
cmp -s "$STAGE/wrapper" "$WRAPPER" || current=no
[ -L "$LINK" ] && [ "$(readlink "$LINK")" = "$WRAPPER" ] || current=no
if [ "$current" = yes ]; then
  say "release $RELEASE is current in $DEST; nothing written"
  exit 0
fi

mkdir -p "$DEST"
files | while read -r i h n p; do printf '%s\n' "$p"; done > "$STAGE/new"
if [ -f "$DEST/$SIDECAR" ]; then
  sed -n 's/^  {"sha256": "[0-9a-f]\{64\}", "path": "\(.*\)"},\{0,1\}$/\1/p' "$DEST/$SIDECAR" \
    | sed 's/\\"/"/g' > "$STAGE/old"
  while IFS= read -r p; do
    case "/$p/" in *//*|*/./*|*/../*) say "skipping unsafe path in the old sidecar: $p"; continue ;; esac
    grep -Fxq -e "$p" "$STAGE/new" && continue
    if [ -f "$DEST/$p" ] || [ -L "$DEST/$p" ]; then
      rm -f "$DEST/$p"
      (cd "$DEST" && rmdir -p "$(dirname "$p")" 2>/dev/null) || true
      say "removed $p"
    fi
  done < "$STAGE/old"
fi
files | while read -r i h n p; do
  if [ -f "$DEST/$p" ] && [ "$(sha "$DEST/$p")" = "$h" ]; then continue; fi
  put "$STAGE/f$i" "$DEST/$p"
  say "wrote $p"
done
put "$STAGE/sidecar" "$DEST/$SIDECAR"
if ! cmp -s "$STAGE/wrapper" "$WRAPPER"; then
  chmod 755 "$STAGE/wrapper"
  put "$STAGE/wrapper" "$WRAPPER"
fi
if ! { [ -L "$LINK" ] && [ "$(readlink "$LINK")" = "$WRAPPER" ]; }; then
  mkdir -p "$BIN"
  ln -sf "$WRAPPER" "$LINK"
fi
say "installed release $RELEASE of scenario $SCENARIO in $ABS; run reef-$ADAPTER (in $BIN)"
case ":$PATH:" in *":$BIN:"*) ;; *) say "add $BIN to PATH to run reef-$ADAPTER" ;; esac
'''


def render_install_script(*, url: str, scenario: str, adapter_name: str, adapter, release_id: str,
                          content_id: str | None, files: dict[str, str]) -> str:
    """The install script of ``files`` (already rendered by ``adapter``) for ``release_id`` of ``scenario``."""
    data = {path: text.encode("utf-8") for path, text in files.items()}
    for path in data:
        _check_path(path)
    paths = sorted_paths(data)
    sidecar = sidecar_text(release_id, content_id, data).encode("utf-8")
    out = ["#!/bin/sh",
           f"# Reef harness installer: scenario {scenario!r}, release {release_id}, adapter {adapter_name}.",
           "# Usage: sh install.sh [DEST] [PREFIX]",
           "#   (defaults ./reef-harness and ${XDG_DATA_HOME:-$HOME/.local/share}/reef)",
           _PRELUDE.rstrip("\n"),
           f"REEF_URL_BAKED={sh_quote(url)}",
           f"SCENARIO={sh_quote(scenario)}",
           f"ADAPTER={sh_quote(adapter_name)}",
           f"AGENT={sh_quote(adapter.binary or '')}",
           f"RELEASE={sh_quote(release_id)}",
           f"SIDECAR={sh_quote(SIDECAR)}",
           f"TREE_SHA256={tree_digest(data)}",
           f"SIDECAR_SHA256={hashlib.sha256(sidecar).hexdigest()}",
           "environment() {", "  :"]
    for name, template in sorted((adapter.environment or {}).items()):
        out.append(f"  printf 'export {name}=%s\\n' \"$(shq {_env_value(template)})\"")
    out.append("}")
    listing = "\n".join(f"{i} {hashlib.sha256(data[p]).hexdigest()} {len(data[p])} {p}" for i, p in enumerate(paths))
    list_delimiter = _delimiter("FILES", listing.encode("utf-8"))
    out += ["files() {", f"  cat <<'{list_delimiter}'", listing, list_delimiter, "}"] if paths else \
        ["files() {", "  :", "}"]
    for i, path in enumerate(paths):
        out += _heredoc(f'"$STAGE/f{i}"', str(i), data[path])
    out += _heredoc('"$STAGE/sidecar"', "SIDECAR", sidecar)
    out.append(_CHECK.rstrip("\n"))
    return "\n".join(out) + "\n"
