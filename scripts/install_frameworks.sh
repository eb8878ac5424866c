#!/usr/bin/env bash
# Install the RL frameworks the trainer plugins are tested against, CPU-only.
#
#   bash scripts/install_frameworks.sh [PYTHON]     (default: python3)
#
# The frameworks' own dependency lists pull GPU stacks (flash-attn, deepspeed,
# vllm, CUDA torch) that the plugins never touch, so the four framework wheels
# are installed with --no-deps and only the small runtime dependencies their
# imported modules need are added. torch is pinned to the version already in
# the environment so nothing swaps in a CUDA build.
#
# Idempotent: when every pinned version is already present it exits in about a
# second without calling pip.
set -euo pipefail

PY="${1:-python3}"

FRAMEWORKS=(
  "verl==0.9.1"
  "tensordict==0.10.0"
  "openrlhf==0.11.2"
  "megatron-core==0.16.1"
)
# Runtime dependencies of the framework modules the plugins and tests import.
RUNTIME=(
  "ray==2.55.0"
  "transformers>=5.5.3,<5.11,!=5.6.0"
  "omegaconf>=2.3"
  "hydra-core>=1.3"
  "pylatexenc"
  "codetiming"
  "dill"
  "cloudpickle"
  "orjson"
  "importlib_metadata"
  "fastapi"   # verl.checkpoint_engine imports verl.workers.rollout.utils, which imports both
  "uvicorn"
)
# pyvers 0.1.x (tensordict 0.10's helper) declares packaging<26 but works with
# packaging 26; installed without deps so it does not downgrade packaging.
NODEPS_EXTRA=("pyvers==0.1.0")

if "$PY" - "${FRAMEWORKS[@]}" "${NODEPS_EXTRA[@]}" ray==2.55.0 <<'PYEOF'
import sys
from importlib import metadata
for spec in sys.argv[1:]:
    name, _, version = spec.partition("==")
    try:
        if metadata.version(name) != version:
            sys.exit(1)
    except metadata.PackageNotFoundError:
        sys.exit(1)
for mod in ("transformers", "omegaconf", "hydra", "pylatexenc", "codetiming", "dill", "cloudpickle", "orjson",
            "fastapi", "uvicorn"):
    try:
        metadata.version({"hydra": "hydra-core"}.get(mod, mod))
    except metadata.PackageNotFoundError:
        sys.exit(1)
PYEOF
then
  echo "install_frameworks: verl, tensordict, openrlhf, megatron-core already installed"
  exit 0
fi

TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)"
if [[ -z "$TORCH_VERSION" ]]; then
  echo "install_frameworks: torch is not installed in $PY; install the project first (pip install -e '.[dev]')" >&2
  exit 1
fi
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==${TORCH_VERSION}" >"$CONSTRAINTS"

echo "install_frameworks: installing with torch==${TORCH_VERSION} pinned"
# (--no-warn-conflicts: the frameworks are installed without their GPU dependencies on purpose, so
# pip's list of what they "require" and is missing is expected, and only noise)
"$PY" -m pip install --disable-pip-version-check -q --no-warn-conflicts -c "$CONSTRAINTS" "${RUNTIME[@]}"
"$PY" -m pip install --disable-pip-version-check -q --no-warn-conflicts --no-deps "${FRAMEWORKS[@]}" "${NODEPS_EXTRA[@]}"
"$PY" -c 'import verl.protocol, tensordict, openrlhf.trainer.ppo_utils, megatron.core.parallel_state' \
  2> >(grep -v -i "warn" >&2)
echo "install_frameworks: done"
