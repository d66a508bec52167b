"""LTX-2 outpainting recipe; the code lives in flextensor_diffusers/recipes/ltx2_outpaint.py.

python recipes/ltx2_outpaint.py --random-weights tiny --canvas 64x64 --source-size 32x32 --steps 2
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flextensor_diffusers.recipes.ltx2_outpaint import cli

if __name__ == "__main__":
    cli()
