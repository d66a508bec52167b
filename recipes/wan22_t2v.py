"""Wan2.2 T2V recipe; the code lives in flextensor_diffusers/recipes/wan22_t2v.py.

python recipes/wan22_t2v.py --random-weights tiny --frames 9 --height 32 --width 32 --steps 2
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flextensor_diffusers.recipes.wan22_t2v import cli

if __name__ == "__main__":
    cli()
