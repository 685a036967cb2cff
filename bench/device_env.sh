# Sourced by the device scripts (device.sh, focus_device.sh): $OUT (default /tmp/out), the carried
# cp312 wheels of .whl/ (device.sh's header lists them) installed into /tmp/site when the GPU
# image lacks grain or ml_collections, unbuffered Python (a call cut off still returns its logs)
# and one persistent XLA compilation cache per machine.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run, not sourced (e.g. --help): say what it is for
  sed -n '1,4s/^# //p' "$0"; exit 0
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ! python3 -c 'import grain, ml_collections' 2>/dev/null; then
  # A warm machine keeps /tmp/site: the same wheels (by name) install once per machine, byte-
  # compiled as pip does by default (a first import would otherwise compile them inside a timing).
  stamp=$(ls .whl/*.whl | md5sum)
  if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
    echo "$stamp" > /tmp/site/.wheels
  fi
  # .whl/stub: stand-in modules an optional package imports (tokamax: xprof.cli.tools).
  export PYTHONPATH=/tmp/site:.whl/stub:$PWD
fi
export PYTHONUNBUFFERED=1
# A later stage or call on the same warm machine loads the programs an earlier one compiled.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
