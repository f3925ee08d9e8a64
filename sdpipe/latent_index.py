"""results/latents/index.json, written by the latents stage and read by training. Its layout version lives here,
between the two, so that training does not import a stage."""

VERSION = 4  # bump when the layout changes: training then asks for `snakemake latents` again
