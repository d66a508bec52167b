"""``flextensor-diffusers`` (or ``python -m flextensor_diffusers``): what can be run, and how."""

from __future__ import annotations

import sys

USAGE = """flextensor-diffusers: run diffusers video pipelines inside a GPU memory budget.

recipes (each takes --help; --random-weights tiny runs on a CPU in seconds):
  flextensor-wan22-t2v          Wan2.2 text-to-video (A14B, two experts)
  flextensor-ltx2-outpaint      LTX-2 video outpainting (a clip on a larger canvas)
  flextensor-cosmos-transfer25  Cosmos-Transfer2.5 (a video following a clip's edges)

native vs offloaded, same seed, with an HTML report:
  flextensor-compare --recipe RECIPE --out report/ -- RECIPE_ARGS...

first run:
  flextensor-wan22-t2v --random-weights tiny
"""


def main(argv: list[str] | None = None) -> int:
    """Print the list of commands; an unknown argument is an error (exit status 2)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] not in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        print(f"error: unknown argument {argv[0]!r}: run one of the commands above", file=sys.stderr)
        return 2
    print(USAGE, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
