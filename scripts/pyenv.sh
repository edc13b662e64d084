# Sourced by test.sh (and the benchmarks' notes): the torch 2.x virtual environment of
# python/requirements-lock.txt, made once per machine and reused while the lock file is
# unchanged.  pyenv_ensure sets ZOFFLOAD_VENV to it (its python is $ZOFFLOAD_VENV/bin/python).
#
# It lives outside the checkout, at a path keyed by the lock file's hash
# (${ZOFFLOAD_VENV_ROOT:-$HOME/.cache/zoffload}/venv-HASH): the torch wheel brings the CUDA
# runtime, about 4.3 GB, which no clean clone should download again.  A venv whose install did
# not finish has no .complete stamp and is made again from scratch.

pyenv_path() {
	local hash
	hash=$(sha256sum python/requirements-lock.txt | cut -c1-12)
	echo "${ZOFFLOAD_VENV_ROOT:-$HOME/.cache/zoffload}/venv-$hash"
}

pyenv_ensure() {
	local venv
	venv=$(pyenv_path)
	if [ ! -f "$venv/.complete" ]; then
		echo "==> making the torch 2.x environment $venv (python/requirements-lock.txt; a few GB, once)"
		rm -rf "$venv"
		mkdir -p "$(dirname "$venv")"
		/usr/bin/python3 -m venv "$venv"
		# --no-deps: the lock file lists the whole closure, so nothing unpinned comes in.
		grep -v '^deepspeed==' python/requirements-lock.txt >"$venv/lock-base.txt"
		"$venv/bin/pip" install -q --no-deps -r "$venv/lock-base.txt"
		"$venv/bin/pip" install -q --no-deps --no-build-isolation \
			"$(grep '^deepspeed==' python/requirements-lock.txt)"
		"$venv/bin/python" -c 'import torch, transformers, accelerate, deepspeed, safetensors, pytest' \
			2>/dev/null || { echo "pyenv: $venv does not import its packages" >&2; return 1; }
		touch "$venv/.complete"
	fi
	ZOFFLOAD_VENV=$venv
	export ZOFFLOAD_VENV
	# DeepSpeed compiles its CPU ops (DeepSpeedCPUAdam) on first use, for minutes: kept
	# beside the venv, so that a clean clone builds them once per machine too.
	TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(dirname "$venv")/torch-extensions}
	export TORCH_EXTENSIONS_DIR
}
