#!/usr/bin/env bash
# Put Ebb into the desktop's application menu (for this user only), pointing at a bundle.
#
#   packaging/install-desktop.sh [--bundle DIR]      install (DIR: the folder holding `Ebb`)
#   packaging/install-desktop.sh --uninstall         remove what install put there
#
# Run from a source checkout it points at dist/Ebb (`make dist`); the bundle carries a copy of
# this script at its top, which points at the bundle it sits in. Files written, under
# ${XDG_DATA_HOME:-~/.local/share}:
#   applications/ebb.desktop                  the menu entry (Exec is the bundle's launcher)
#   icons/hicolor/scalable/apps/ebb.svg        its icon
#   mime/packages/ebb-gguf.xml                 the GGUF file type, so .gguf files open in Ebb
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
data="${XDG_DATA_HOME:-$HOME/.local/share}"
desktop="$data/applications/ebb.desktop"
icon="$data/icons/hicolor/scalable/apps/ebb.svg"
mime="$data/mime/packages/ebb-gguf.xml"

refresh() {  # the menu and file managers pick changes up without these, only later
    command -v update-desktop-database >/dev/null && update-desktop-database -q "$data/applications" || true
    command -v update-mime-database >/dev/null && update-mime-database "$data/mime" >/dev/null 2>&1 || true
    command -v gtk-update-icon-cache >/dev/null && gtk-update-icon-cache -q -t "$data/icons/hicolor" 2>/dev/null || true
}

if [[ "${1:-}" == "--uninstall" ]]; then
    rm -f "$desktop" "$icon" "$mime"
    [[ -d "$data/mime" ]] && refresh
    echo "Ebb removed from the application menu (the bundle and your conversations are untouched)"
    exit 0
fi

bundle=""
if [[ "${1:-}" == "--bundle" ]]; then
    bundle="${2:?--bundle needs the folder that holds the Ebb launcher}"
elif [[ -n "${1:-}" ]]; then
    echo "usage: $0 [--bundle DIR] | --uninstall" >&2
    exit 2
elif [[ -x "$here/Ebb" ]]; then
    bundle="$here"
else
    bundle="$here/../dist/Ebb"
fi
if [[ ! -x "$bundle/Ebb" ]]; then
    echo "no Ebb launcher in $bundle: build the bundle with 'make dist', or pass --bundle DIR" >&2
    exit 1
fi
bundle="$(cd "$bundle" && pwd)"
resources="$bundle/_internal/resources"

mkdir -p "$(dirname "$desktop")" "$(dirname "$icon")" "$(dirname "$mime")"
install -m 644 "$resources/ebb.svg" "$icon"
cat > "$mime" <<'XML'
<?xml version="1.0" encoding="UTF-8"?>
<mime-info xmlns="http://www.freedesktop.org/standards/shared-mime-info">
  <mime-type type="application/x-gguf">
    <comment>GGUF model</comment>
    <magic priority="50"><match type="string" offset="0" value="GGUF"/></magic>
    <glob pattern="*.gguf"/>
  </mime-type>
</mime-info>
XML
# the template's Exec/TryExec name the command; here they name the bundle's launcher (quoted:
# the path may hold spaces)
sed -e "s|^Exec=.*|Exec=\"$bundle/Ebb\" %F|" \
    -e "s|^TryExec=.*||" \
    -e "/^Exec=/a TryExec=$bundle/Ebb" \
    -e "s|^MimeType=.*|MimeType=application/x-gguf;image/png;image/jpeg;image/webp;video/mp4;video/webm;video/quicktime;video/x-matroska;application/pdf;|" \
    "$resources/ebb.desktop" > "$desktop"
chmod 644 "$desktop"
refresh
echo "Ebb added to the application menu: $desktop (runs $bundle/Ebb)"
