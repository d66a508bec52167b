"""What recipes and reports both write: mp4 files (`video`), every file whole or not at all (`files`).

A module of its own so that the recipes (which write a video) and the reports (which run recipes and compare
their videos) each import it, and not one another's internals: reports depend on recipes, never the reverse."""
