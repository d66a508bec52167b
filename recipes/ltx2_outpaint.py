"""`flextensor-ltx2-outpaint` for a clone that is not installed (same arguments).

The code is flextensor_diffusers/recipes/ltx2_outpaint.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flextensor_diffusers.recipes.ltx2_outpaint import cli

if __name__ == "__main__":
    cli()
