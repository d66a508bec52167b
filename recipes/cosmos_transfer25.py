"""Cosmos-Transfer2.5 recipe; the code lives in flextensor_diffusers/recipes/cosmos_transfer25.py.

python recipes/cosmos_transfer25.py --random-weights tiny --frames 5 --height 32 --width 32 --steps 2 --chunk 16
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flextensor_diffusers.recipes.cosmos_transfer25 import cli

if __name__ == "__main__":
    cli()
