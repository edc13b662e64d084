#!/bin/sh
# meson install script: installs the default configuration unless one is already there, so
# that reinstalling or upgrading never overwrites what an administrator wrote.
# usage: install-config.sh SOURCE SYSCONFDIR   ($DESTDIR honoured, as meson sets it)
set -eu
src=$1
dir=${DESTDIR:-}$2
dest=$dir/zoffload.conf
if [ -e "$dest" ]; then
	echo "Keeping existing $dest (the default is in the documentation directory)"
	exit 0
fi
mkdir -p "$dir"
install -m 0644 "$src" "$dest"
echo "Installing $dest"
