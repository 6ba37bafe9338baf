# Sourced by the GPU sweep scripts: the GPU machine has no fastapi/uvicorn/pyzmq and no
# network, so they come from wheels carried in .whl/serve (bash benchmark/fetch_server_wheels.sh
# here), installed into a private folder on PYTHONPATH. pyzmq is what --engine-process
# (ENGINE_PROCESS=1) talks through; the in-process server does not need it.
# ensure_web_stack WORK_DIR
ensure_web_stack() {
  if ! "$PYTHON" -c "import fastapi, uvicorn, zmq" 2> /dev/null; then
    local site="$1/site"
    "$PYTHON" -m pip install -q --no-index --find-links "${SERVER_WHEELS:-.whl/serve}" \
      --target "$site" fastapi uvicorn pyzmq
    export PYTHONPATH="$PYTHONPATH:$site"
  fi
}
