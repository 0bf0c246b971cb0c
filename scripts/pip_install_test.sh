#!/usr/bin/env bash
# `pip install .` from this checkout into a fresh venv (Debian's system packages visible, no build
# isolation: there is no PyPI here), then `import r3` and `r3 --help` from the venv. Reuses the
# CMake build folder given as $1 (default build) so nothing is compiled twice.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
VENV=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$VENV")"' EXIT
/usr/bin/python3 -m venv --system-site-packages "$VENV"
R3_CMAKE_BUILD_DIR="$BUILD" "$VENV/bin/pip" install --quiet --no-build-isolation --no-deps --no-index . \
  >/dev/null
cd "$(dirname "$VENV")"  # away from the checkout: the installed package must be the one imported
"$VENV/bin/python" - <<'PY'
import r3, numpy
assert r3.__file__.startswith(__import__("sys").prefix), r3.__file__
print("pip-install: imported", r3.__file__, "with", ", ".join(n for n in r3.__all__))
PY
"$VENV/bin/r3" --help | head -1
"$VENV/bin/r3" make-model --arch olmoe --preset tiny --out model >/dev/null
"$VENV/bin/python" -c "
import r3
out = r3.LLM(model='model', enable_return_routed_experts=True).generate([[3, 4, 5]], r3.SamplingParams(max_tokens=3, seed=1))
assert out[0].outputs[0].routed_experts.shape[0] == 5
print('pip-install: LLM.generate from the installed package works')"
echo "1 passed, 0 failed"
