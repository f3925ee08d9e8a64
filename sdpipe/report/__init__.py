"""Helpers of the report stage (sdpipe/stages/report.py).

sources reads what the earlier stages wrote, document is the format-neutral model of the report (sections of
tables, figures and notes), sections fills it, plots and grids draw its images, render writes HTML and Markdown from
the one model, so both formats always state the same facts.
"""
