# Sourced by the device-call scripts (gpu_session.sh, study_device.sh, focus_device.sh): $OUT,
# and the carried cp312 wheels (.whl/: grain, ml_collections, tokamax's dependencies, ...) that
# the GPU image lacks, installed into /tmp/site; unbuffered Python so a cut-off call still
# returns its logs.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ! python3 -c 'import grain, ml_collections' 2>/dev/null; then
  # A warm machine keeps /tmp/site: the same wheels (by name) install once per machine, which
  # saves ~10 s of every later script run of a call or of the next calls.
  stamp=$(ls .whl/*.whl | md5sum)
  if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
    echo "$stamp" > /tmp/site/.wheels
  fi
  export PYTHONPATH=/tmp/site:.whl/stub:$PWD
fi
export PYTHONUNBUFFERED=1
# One persistent XLA compilation cache per machine: a second arm of the same shapes (or its
# evaluation) in a later stage or call on the warm machine loads the programs the first compiled
# (fifteenth session: an adapter stage took 26 s to its 10th step, then ran at 4-9 steps/s,
# compiling each new memory length, until step ~250, against ~14.8 steps/s after).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache}
