"""What a comparison leaves behind: fidelity metrics, plots and the HTML page (`quality`), and the
native-vs-offloaded comparison that produces them (`compare`). Videos and atomic files are written by
`flextensor_diffusers.media`, which the recipes use too."""
