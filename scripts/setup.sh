#!/usr/bin/env bash
# Idempotent setup for hvd_ext on a Debian/Ubuntu machine (run as root, or with sudo for apt).
#   - OpenMPI from apt (plus iproute2 for the shaped-network benchmarks)
#   - a virtual environment at .venv in the repository root
#   - torch 2.13.0, numpy, mpi4py, pytest, hypothesis, mnist1d, tqdm, matplotlib, cupy
#   - horovod 0.28.1 built from source with PyTorch + MPI + Gloo
#     (and NCCL GPU operations when CUDA and NCCL are found)
#   - hvd_ext installed editable
# A second run only checks what is there and finishes in seconds.
# On a cluster, run it once on every node (same path), e.g.:
#   for h in node1 node2; do ssh $h "cd $PWD && bash scripts/setup.sh"; done
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
HOROVOD_VERSION="${HOROVOD_VERSION:-0.28.1}"
STEP="start"
trap 'echo "setup.sh: FAILED at step: $STEP (see the output above)" >&2' ERR

log() { echo "[setup] $*"; }

STEP="system packages (OpenMPI, iproute2, build tools)"
need_apt=()
command -v mpirun >/dev/null 2>&1 || need_apt+=(openmpi-bin)
[ -e /usr/include/x86_64-linux-gnu/openmpi/mpi.h ] || [ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] \
  || dpkg -s libopenmpi-dev >/dev/null 2>&1 || need_apt+=(libopenmpi-dev)
command -v tc >/dev/null 2>&1 || need_apt+=(iproute2)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
"$PY" -c 'import venv, ensurepip' >/dev/null 2>&1 || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "apt-get install ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
else
  log "system packages present"
fi

STEP="virtual environment at .venv"
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install -q)

# A GPU node: a visible NVIDIA device. The CUDA major version picks the CuPy wheel (a wheel of
# another major version cannot load): torch's CUDA build when torch is one (read after torch is
# installed, below), else the driver's (nvidia-smi), else 12. NCCL (system library or
# HOROVOD_NCCL_HOME) lets Horovod run its collectives on the GPU.
have_cuda=0; cuda_major=12; have_nccl=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  have_cuda=1
  v=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -1)
  [ -n "$v" ] && cuda_major="$v"
  if [ -n "${HOROVOD_NCCL_HOME:-}" ] || ldconfig -p 2>/dev/null | grep -q libnccl; then have_nccl=1; fi
fi
if [ -x "$VPY" ]; then
  v=$("$VPY" -c 'import torch; print((torch.version.cuda or "").split(".")[0])' 2>/dev/null || true)
  [ -n "$v" ] && cuda_major="$v"
fi
cupy_for() { case "$1" in 11) echo cupy-cuda11x;; 13) echo cupy-cuda13x;; *) echo cupy-cuda12x;; esac; }
CUPY=$(cupy_for "$cuda_major")

STEP="python packages (torch, numpy, mpi4py, pytest, import-linter, mnist1d, tqdm, matplotlib, cupy)"
if ! "$VPY" - <<PYEOF >/dev/null 2>&1
import importlib.metadata as m, sys
need = {"torch": "$TORCH_VERSION"}
for name in ["numpy", "mpi4py", "pytest", "mnist1d", "tqdm", "matplotlib", "$CUPY", "psutil", "cloudpickle", "pytest-timeout", "hypothesis", "import-linter"]:
    m.version(name)
v = m.version("torch").split("+")[0]
sys.exit(0 if v == need["torch"] else 1)
PYEOF
then
  log "pip install torch==$TORCH_VERSION and friends"
  "${PIP[@]}" --upgrade pip setuptools wheel
  "${PIP[@]}" "torch==$TORCH_VERSION"
  "${PIP[@]}" numpy mpi4py pytest pytest-timeout hypothesis import-linter mnist1d tqdm matplotlib psutil cloudpickle packaging pyyaml
  # CuPy for the CUDA major version torch was built for (now that torch is here); it imports without
  # a GPU, and without a usable CuPy the kernels' torch code runs (one warning).
  v=$("$VPY" -c 'import torch; print((torch.version.cuda or "").split(".")[0])' 2>/dev/null || true)
  [ -n "$v" ] && CUPY=$(cupy_for "$v")
  "${PIP[@]}" "$CUPY" || log "warning: $CUPY could not be installed; GPU kernels disabled (torch fallback)"
else
  log "python packages present"
fi

STEP="horovod $HOROVOD_VERSION (build from source with PyTorch + MPI + Gloo)"
if "$VPY" -c "import horovod, horovod.torch as h; assert horovod.__version__ == '$HOROVOD_VERSION'; assert h.mpi_built() and h.gloo_built()" >/dev/null 2>&1 \
   && { [ $have_nccl -eq 0 ] || "$VPY" -c "import horovod.torch as h; assert h.nccl_built()" >/dev/null 2>&1; }; then
  log "horovod present"
else
  # Horovod 0.28.1's CMake forces -std=c++14 but torch 2.13 headers need C++17:
  # a tiny compiler wrapper rewrites the flag.
  WRAP="$VENV/cxx17-wrapper"
  mkdir -p "$WRAP"
  cat > "$WRAP/g++" <<'WEOF'
#!/usr/bin/env bash
args=()
for a in "$@"; do
  case "$a" in -std=c++14|-std=gnu++14) args+=("-std=c++17");; *) args+=("$a");; esac
done
exec /usr/bin/g++ "${args[@]}"
WEOF
  chmod +x "$WRAP/g++"
  export CXX="$WRAP/g++"
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
  export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
  if [ $have_nccl -eq 1 ]; then
    log "CUDA device and NCCL found: building Horovod with HOROVOD_GPU_OPERATIONS=NCCL"
    export HOROVOD_GPU_OPERATIONS=NCCL
    # a wheel cached from a CPU-only build must not be reused here
    NOCACHE=(--no-cache-dir)
  elif [ $have_cuda -eq 1 ]; then
    log "warning: CUDA device found but no NCCL library: Horovod is built without GPU collectives"
  fi
  cm_major=$(cmake --version | head -1 | sed 's/[^0-9]*\([0-9]*\).*/\1/')
  if [ "${cm_major:-3}" -ge 4 ]; then export CMAKE_POLICY_VERSION_MINIMUM=3.5; fi
  export MAKEFLAGS="-j$(nproc)"
  log "building horovod==$HOROVOD_VERSION (about 6 minutes on 2 cores; the built wheel is cached by pip)"
  "$VPY" -m pip install -q --no-build-isolation ${NOCACHE[@]+"${NOCACHE[@]}"} "horovod==$HOROVOD_VERSION"
  "$VPY" -c "import horovod.torch as h; assert h.mpi_built() and h.gloo_built(), 'horovod built without MPI/Gloo'"
fi

STEP="hvd_ext (editable install)"
if ! (cd / && "$VPY" -c "import hvd_ext, os; assert os.path.realpath(os.path.dirname(hvd_ext.__file__)) == os.path.realpath('$ROOT/hvd_ext')") >/dev/null 2>&1; then
  log "pip install -e ."
  "$VPY" -m pip install -q --no-build-isolation --no-deps -e .
else
  log "hvd_ext present"
fi
log "done: activate with 'source .venv/bin/activate'"
