"""The `r3` command of an installed package: runs the r3 binary shipped inside it."""
import os
import sys
from pathlib import Path


def main():
    binary = Path(__file__).resolve().parent / "bin" / "r3"
    if not binary.exists():
        sys.exit(f"r3: the r3 binary is missing from {binary.parent} (reinstall the package)")
    os.execv(str(binary), [str(binary)] + sys.argv[1:])


if __name__ == "__main__":
    main()
