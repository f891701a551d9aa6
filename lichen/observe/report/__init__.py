"""`lichen report RUN_DIR [-o report.html]`: a run directory as one self-contained web page.

The page (no network: its script, styles and charts are inline) shows the curves of metrics.jsonl with the step
time stacked by phase and the memory per phase, a sample browser over the sample log (--log-samples), the run's
config and its checkpoints. `data.py` gathers what the run directory holds, `page.py` writes the HTML around
`report.js` and `report.css`, `cli.py` is the command. Re-run it to refresh the page of a run still going.
"""
