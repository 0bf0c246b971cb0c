# pytest setup for the r3 Python module: imports it from $R3_BUILD/python (default: build) and
# makes tiny checkpoints with `r3 make-model`. Run: R3_BUILD=build /usr/bin/python3 -m pytest tests/python
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, os.environ.get("R3_BUILD", "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))
R3_BIN = os.path.join(BUILD, "r3")


@pytest.fixture(scope="session")
def r3_bin():
    assert os.access(R3_BIN, os.X_OK), f"{R3_BIN} is not built (set R3_BUILD)"
    return R3_BIN


@pytest.fixture(scope="session")
def make_model(tmp_path_factory, r3_bin):
    made = {}

    def make(arch="olmoe", seed=0):
        key = (arch, seed)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{arch}_{seed}")
            subprocess.run([r3_bin, "make-model", "--arch", arch, "--preset", "tiny", "--seed", str(seed),
                            "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
            made[key] = str(out)
        return made[key]

    return make
