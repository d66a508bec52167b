"""`flextensor-wan22-t2v` for a clone that is not installed (same arguments).

The code is flextensor_diffusers/recipes/wan22_t2v.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flextensor_diffusers.recipes.wan22_t2v import cli

if __name__ == "__main__":
    cli()
