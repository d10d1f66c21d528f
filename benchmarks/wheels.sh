# Sourced by gpu_suite.sh and gpu_lanes.sh: puts the wheels carried from
# benchmarks/fetch_wheels.sh (the device has no registry) on PYTHONPATH, installing them
# into /tmp/site once per process tree (JAXATTN_WHEELS_INSTALLED marks it done, so the
# lanes of gpu_lanes.sh never install into the same folder at once).
install_wheels() {
  if [[ -z "${JAXATTN_WHEELS_INSTALLED:-}" ]]; then
    compgen -G ".whl/*.whl" > /dev/null || return 0
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || return 1
    export JAXATTN_WHEELS_INSTALLED=1
  fi
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
}
