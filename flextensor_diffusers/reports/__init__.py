"""What a run leaves behind: mp4 files (`video`), fidelity metrics, plots and the HTML page (`quality`), and
the native-vs-offloaded comparison that produces them (`compare`). Every file is written whole or not at all
(`files`)."""
